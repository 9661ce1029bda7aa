"""Finding and loading libmoe.so, and the C signature of every public function.

Where the library comes from, first match wins:
  1. the path given to libmoe.load(path);
  2. the MOE_LIBRARY environment variable (a file path);
  3. the copy inside this package, libmoe/libmoe.so.<major>.<minor> (the wheel's, placed there
     by scripts/python-wheel.sh);
  4. the dynamic loader's own rules (LD_LIBRARY_PATH, the ld.so cache, RUNPATH) for the SONAME
     this package is written against, then for plain libmoe.so, then ctypes.util.find_library.
libmoe.library() says which file was loaded and why; a failure lists every attempt.

SIGNATURES is the one table of the C API: each entry gives the return kind and argument types.
Functions returning moe_status_t raise libmoe.Error on failure (STATUS) or hand the status back
(RAW, for poll-like calls where IN_PROGRESS or TIMEOUT is an answer, not a failure). A function
the loaded library lacks (an older libmoe) raises Error(UNSUPPORTED) when called.
"""
import ctypes as C
import ctypes.util
import os
import threading

from . import _structs as S
from ._version import API_MAJOR, API_MINOR
from .enums import Status, as_status
from .errors import Error, LibraryNotFound

ENV_VAR = "MOE_LIBRARY"
STATUS, RAW = "status", "raw"

_vp, _i32, _i64 = C.c_void_p, C.c_int32, C.c_int64
_pi32, _pi64 = C.POINTER(C.c_int32), C.POINTER(C.c_int64)
_T, _pT, _e, _pe = S.Tensor, C.POINTER(S.Tensor), S.enum_t, C.POINTER(S.enum_t)
_pvp, _str = C.POINTER(C.c_void_p), C.c_char_p
_pCT = C.POINTER(S.CkptTensor)

SIGNATURES = {
    # core.h
    "moe_version": (C.c_int, []),
    "moe_version_string": (_str, []),
    "moe_status_string": (_str, [_e]),
    "moe_last_error": (_str, []),
    "moe_dtype_size": (C.c_size_t, [_e]),
    "moe_dtype_name": (_str, [_e]),
    "moe_tensor_view": (STATUS, [_vp, _e, _e, _i32, _pi64, _pT]),
    "moe_tensor_numel": (_i64, [_pT]),
    "moe_runtime_config_default": (S.RuntimeConfig, []),
    "moe_runtime_create": (STATUS, [C.POINTER(S.RuntimeConfig), _pvp]),
    "moe_runtime_destroy": (STATUS, [_vp]),
    "moe_runtime_backend": (STATUS, [_vp, _pe]),
    "moe_runtime_device": (STATUS, [_vp, _pe, _pi32]),
    "moe_runtime_compute_dtype": (STATUS, [_vp, _pe]),
    "moe_runtime_set_stream": (STATUS, [_vp, _vp]),
    "moe_runtime_get_stream": (STATUS, [_vp, _pvp]),
    "moe_runtime_synchronize": (STATUS, [_vp]),
    "moe_runtime_set_log": (STATUS, [_vp, _e, S.LOG_FN, _vp]),
    "moe_runtime_get_async_error": (RAW, [_vp, C.c_char_p, C.c_size_t]),
    "moe_runtime_wait_stats": (STATUS, [_vp, C.POINTER(S.RuntimeWaitStats)]),
    "moe_tensor_alloc": (STATUS, [_vp, _e, _e, _i32, _pi64, _pT]),
    "moe_tensor_free": (STATUS, [_vp, _pT]),
    "moe_tensor_copy": (STATUS, [_vp, _pT, _pT]),
    # mesh.h
    "moe_mesh_config_default": (S.MeshConfig, []),
    "moe_runtime_axis": (STATUS, [_vp, _e, _pi32, _pi32]),
    # layer.h
    "moe_layer_config_default": (S.LayerConfig, []),
    "moe_layer_create": (STATUS, [_vp, C.POINTER(S.LayerConfig), _pvp]),
    "moe_layer_create_seeded": (STATUS, [_vp, C.POINTER(S.LayerConfig), C.c_uint64, _pvp]),
    "moe_layer_destroy": (STATUS, [_vp]),
    "moe_layer_forward": (STATUS, [_vp, _i32, _pT, _pT]),
    "moe_layer_backward": (STATUS, [_vp, _i32, _pT, _pT]),
    "moe_layer_release_slot": (STATUS, [_vp, _i32]),
    "moe_layer_zero_grad": (STATUS, [_vp]),
    "moe_layer_discard_grad": (STATUS, [_vp]),
    "moe_layer_num_params": (STATUS, [_vp, _pi32]),
    "moe_layer_param": (STATUS, [_vp, _i32, C.POINTER(S.ParamInfo)]),
    "moe_layer_expert_id": (STATUS, [_vp, _i32, _pi32]),
    "moe_layer_stats": (STATUS, [_vp, C.POINTER(S.LayerStats), _pi64]),
    # optim.h
    "moe_adamw_config_default": (S.AdamWConfig, []),
    "moe_adamw_create": (STATUS, [_vp, C.POINTER(S.AdamWConfig), _pvp]),
    "moe_adamw_destroy": (STATUS, [_vp]),
    "moe_adamw_add_layer": (STATUS, [_vp, _vp, _str]),
    "moe_adamw_add_param": (STATUS, [_vp, _str, _e, _pT, _pT]),
    "moe_adamw_start_grad_sync": (STATUS, [_vp, _vp]),
    "moe_adamw_step": (STATUS, [_vp, C.c_float, C.c_float]),
    "moe_adamw_num_states": (STATUS, [_vp, _pi32]),
    "moe_adamw_state": (STATUS, [_vp, _i32, C.POINTER(S.ParamInfo)]),
    "moe_adamw_step_count": (STATUS, [_vp, _pi64]),
    "moe_adamw_set_step_count": (STATUS, [_vp, _i64]),
    "moe_adamw_set_grad_clip": (STATUS, [_vp, C.c_float]),
    "moe_adamw_set_lr_schedule": (STATUS, [_vp, C.POINTER(S.LrSchedule)]),
    "moe_adamw_last_step": (STATUS, [_vp, C.POINTER(C.c_float), C.POINTER(C.c_double)]),
    "moe_adamw_state_owner": (STATUS, [_vp, _i32, _pe, _pvp]),
    "moe_lr_schedule_rate": (C.c_float, [C.POINTER(S.LrSchedule), C.c_float, _i64]),
    # ckpt.h
    "moe_ckpt_config_default": (S.CkptConfig, []),
    "moe_ckpt_tensor_whole": (S.CkptTensor, [_str, _pT]),
    "moe_ckpt_create": (STATUS, [_vp, C.POINTER(S.CkptConfig), _pvp]),
    "moe_ckpt_destroy": (STATUS, [_vp]),
    "moe_ckpt_destroy_within": (STATUS, [_vp, _i64]),
    "moe_ckpt_abort": (None, [_vp]),
    "moe_ckpt_save_async": (STATUS, [_vp, _i64, _pCT, _i32]),
    "moe_ckpt_fence": (STATUS, [_vp]),
    "moe_ckpt_status": (STATUS, [_vp, C.POINTER(S.CkptStatus)]),
    "moe_ckpt_poll": (RAW, [_vp, C.c_int]),
    "moe_ckpt_wait": (RAW, [_vp, C.c_int, _i64]),
    "moe_ckpt_get_async_error": (RAW, [_vp, C.c_char_p, C.c_size_t]),
    "moe_ckpt_load_latest": (STATUS, [_vp, _pCT, _i32, _pi64]),
    "moe_ckpt_load_step": (STATUS, [_vp, _i64, _pCT, _i32]),
    "moe_ckpt_list": (STATUS, [_vp, _e, _pi64, _i32, _pi32]),
    "moe_ckpt_set_aside_newer": (STATUS, [_vp, _i64, _pi32]),
    # train_state.h
    "moe_train_state_create": (STATUS, [_pvp]),
    "moe_train_state_destroy": (STATUS, [_vp]),
    "moe_train_state_add_layer": (STATUS, [_vp, _vp, _str]),
    "moe_train_state_add_adamw": (STATUS, [_vp, _vp, _str]),
    "moe_train_state_add_tensor": (STATUS, [_vp, _pCT, _e]),
    "moe_ckpt_save_train_state": (STATUS, [_vp, _i64, _vp]),
    "moe_ckpt_load_train_state": (STATUS, [_vp, _i64, _vp, _pi64]),
    # pipeline.h
    "moe_pipeline_schedule_create": (STATUS, [_i32, _i32, _i32, _pvp]),
    "moe_pipeline_schedule_create_interleaved": (STATUS, [_i32, _i32, _i32, _i32, _pvp]),
    "moe_pipeline_schedule_destroy": (STATUS, [_vp]),
    "moe_pipeline_schedule_length": (STATUS, [_vp, _pi32]),
    "moe_pipeline_schedule_action": (STATUS, [_vp, _i32, C.POINTER(S.PipelineAction)]),
    "moe_pipeline_schedule_info": (STATUS, [_vp, _pi32, _pi32, _pi32, _pi32]),
    "moe_pipeline_schedule_virtual_stages": (STATUS, [_vp, _pi32]),
    "moe_pipeline_op_string": (_str, [_e]),
    "moe_pipeline_schedule_to_string": (STATUS, [_vp, C.c_char_p, C.c_size_t,
                                                 C.POINTER(C.c_size_t)]),
    "moe_pipeline_config_default": (S.PipelineConfig, []),
    "moe_pipeline_create": (STATUS, [_vp, C.POINTER(S.PipelineConfig),
                                     C.POINTER(S.PipelineCallbacks), _pvp]),
    "moe_pipeline_destroy": (STATUS, [_vp]),
    "moe_pipeline_get_schedule": (STATUS, [_vp, _pvp]),
    "moe_pipeline_train_step": (STATUS, [_vp, C.POINTER(C.c_double)]),
    "moe_pipeline_stats": (STATUS, [_vp, C.POINTER(S.PipelineStats)]),
    # elastic.h
    "moe_elastic_member_config_default": (S.ElasticMemberConfig, []),
    "moe_elastic_member_create": (STATUS, [C.POINTER(S.ElasticMemberConfig), _pvp]),
    "moe_elastic_member_create_from_env": (STATUS, [_i32, _pvp]),
    "moe_elastic_member_report": (STATUS, [_vp, _e, _i64]),
    "moe_elastic_member_report_busy": (STATUS, [_vp, _i64, C.c_double]),
    "moe_elastic_member_slot": (STATUS, [_vp, _pi32]),
    "moe_elastic_member_report_exit": (STATUS, [_vp, _i32, _str]),
    "moe_elastic_member_watch_launcher": (STATUS, [_vp, _str, _i32]),
    "moe_elastic_member_set_orphan_handler": (STATUS, [_vp, S.ORPHAN_FN, _vp]),
    "moe_elastic_member_destroy": (STATUS, [_vp]),
}


class _DlInfo(C.Structure):
    _fields_ = [("dli_fname", C.c_char_p), ("dli_fbase", C.c_void_p),
                ("dli_sname", C.c_char_p), ("dli_saddr", C.c_void_p)]


def _file_of(func):
    """The file the loader mapped func from (dladdr), or None."""
    try:
        info = _DlInfo()
        if C.CDLL(None).dladdr(C.cast(func, C.c_void_p), C.byref(info)) and info.dli_fname:
            return os.path.realpath(info.dli_fname.decode())
    except (OSError, AttributeError):
        pass
    return None


def _version_string(code):
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


class Library:
    """The loaded libmoe: every SIGNATURES entry as an attribute, plus where it came from."""

    def __init__(self, cdll, how):
        self.cdll = cdll
        self.how = how
        for name, (result, argtypes) in SIGNATURES.items():
            setattr(self, name, self._bind(name, result, argtypes))
        self.path = _file_of(cdll.moe_version) or cdll._name
        self.version = self.moe_version()

    def _bind(self, name, result, argtypes):
        try:
            func = getattr(self.cdll, name)
        except AttributeError:
            def missing(*_args):
                raise Error(Status.UNSUPPORTED, f"the loaded libmoe ({self.path}) has no {name}",
                            name)
            return missing
        func.argtypes = argtypes
        if result == STATUS:
            func.restype = S.status_t
            func.errcheck = self._raise_on_failure
        elif result == RAW:
            func.restype = S.status_t
            func.errcheck = lambda status, _f, _a: as_status(status)
        else:
            func.restype = result
        return func

    def _raise_on_failure(self, status, func, _args):
        if status != Status.SUCCESS:
            raise Error(status, self.last_error(), func.__name__)
        return status

    def last_error(self):
        return self.moe_last_error().decode(errors="replace")

    def __repr__(self):
        return f"<libmoe {_version_string(self.version)} from {self.path} ({self.how})>"


_lock = threading.Lock()
_loaded = None


def _candidates(path):
    if path is not None:
        return [(os.fspath(path), "the path given to libmoe.load()")]
    env = os.environ.get(ENV_VAR)
    if env:
        return [(env, f"{ENV_VAR}={env}")]
    here = os.path.dirname(os.path.abspath(__file__))
    # any libmoe.so* here: one of another version is loaded and refused by the version check
    found = [(os.path.join(here, name), "bundled with the package")
             for name in sorted(os.listdir(here)) if name.startswith("libmoe.so")]
    rule = "the dynamic loader's search path (LD_LIBRARY_PATH, ld.so cache, RUNPATH)"
    found += [(f"libmoe.so.{API_MAJOR}.{API_MINOR}", rule), ("libmoe.so", rule)]
    name = ctypes.util.find_library("moe")
    if name:
        found.append((name, "ctypes.util.find_library('moe')"))
    return found


def _check_version(lib):
    major, minor = lib.version // 10000, lib.version // 100 % 100
    # before 1.0 every minor release may break the ABI (the SONAME carries major.minor)
    ok = major == API_MAJOR and (minor == API_MINOR if API_MAJOR == 0 else minor >= API_MINOR)
    if not ok:
        raise Error(Status.UNSUPPORTED,
                    f"libmoe {_version_string(lib.version)} was loaded from {lib.path} "
                    f"({lib.how}), but this package is written for {API_MAJOR}.{API_MINOR}.x")


def load(path=None):
    """Load libmoe.so (see the module text for the search order) and return the Library.
    Later calls return the loaded one; naming a different file then raises Error."""
    global _loaded
    with _lock:
        if _loaded is not None:
            if path is not None and os.path.realpath(os.fspath(path)) != _loaded.path:
                raise Error(Status.INVALID_ARGUMENT,
                            f"libmoe is already loaded from {_loaded.path}; one process loads "
                            f"one libmoe (asked for {path})")
            return _loaded
        tried = []
        for candidate, how in _candidates(path):
            try:
                # RTLD_GLOBAL: Open MPI's plugins, loaded later, resolve libmpi's symbols
                # through the global scope
                cdll = C.CDLL(candidate, mode=C.RTLD_GLOBAL)
            except OSError as exc:
                tried.append(f"  {candidate} ({how}): {exc}")
                continue
            lib = Library(cdll, how)
            _check_version(lib)
            _loaded = lib
            return lib
        raise LibraryNotFound("libmoe.so was not found; tried:\n" + "\n".join(tried) +
                              f"\nPass its path to libmoe.load(path) or set {ENV_VAR}.")


def lib():
    """The loaded Library, loading it on first use."""
    return _loaded if _loaded is not None else load()
