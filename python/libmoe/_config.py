"""Config structs from keyword arguments, and records (dataclasses) from out-structs.

A config starts as the C library's own moe_<x>_config_default(), so every keyword left out keeps
the C default; each keyword names a struct field. Enum fields take members, ints or names
("sigmoid"); string fields take str or path-like. A record type is made from a struct's
fields, so a field added to a C struct (and its mirror in _structs.py) shows up by itself.
"""
import ctypes as C
import dataclasses
import os

from .enums import (Backend, CkptState, CommBackend, DType, LogLevel, ParamKind, PipeIssue,
                    Placement, ScoreFn, Status, to_enum)

ENUM_FIELDS = {"backend": Backend, "log_level": LogLevel, "comm": CommBackend,
               "score_fn": ScoreFn, "placement": Placement, "act_dtype": DType,
               "issue": PipeIssue, "state": CkptState, "kind": ParamKind,
               "last_upload_error": Status}


def _settable(struct):
    """Scalar and string fields; pointers, arrays and callbacks are the wrappers' to set."""
    return [name for name, ctype in struct._fields_
            if name != "struct_size" and issubclass(ctype, C._SimpleCData)]


def fill(struct, kwargs, what, fixed=()):
    """Set struct's fields from kwargs; fixed names are set by the wrapper, not the caller."""
    types = dict(struct._fields_)
    allowed = [n for n in _settable(struct) if n not in fixed]
    for name, value in kwargs.items():
        if name not in allowed:
            raise TypeError(f"{what} has no option {name!r}; options: {', '.join(allowed)}")
        if value is None and types[name] is not C.c_char_p:
            continue  # None keeps the C default
        if name in ENUM_FIELDS:
            value = int(to_enum(ENUM_FIELDS[name], value))
        elif types[name] is C.c_char_p:
            value = None if value is None else os.fsencode(value)
        elif isinstance(value, bool):
            value = int(value)
        setattr(struct, name, value)
    return struct


def record_type(name, struct, extra=(), doc=None):
    """A frozen dataclass with struct's fields (struct_size left out) and extra field names."""
    names = [n for n, _ in struct._fields_ if n != "struct_size"] + list(extra)
    cls = dataclasses.make_dataclass(name, names, frozen=True)
    cls.__module__ = "libmoe"
    cls.__doc__ = doc
    return cls


def record(cls, struct, **extra):
    values = {}
    for field in dataclasses.fields(cls):
        if field.name in extra:
            values[field.name] = extra[field.name]
            continue
        value = getattr(struct, field.name)
        if field.name in ENUM_FIELDS:
            try:
                value = ENUM_FIELDS[field.name](value)
            except ValueError:  # a value a newer library added: kept as the int
                pass
        elif isinstance(value, bytes):
            value = value.decode()
        values[field.name] = value
    return cls(**values)


def as_dict(struct):
    return {n: getattr(struct, n) for n, _ in struct._fields_ if n != "struct_size"}
