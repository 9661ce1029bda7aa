"""The C API's enums (include/moe/*.h) as Python IntEnums, and one converter from the names
users write ("sigmoid", "bf16", Backend.HOST, 1) to the enum member."""
import enum


class Status(enum.IntEnum):
    SUCCESS = 0
    INVALID_ARGUMENT = 1
    INVALID_HANDLE = 2
    UNSUPPORTED = 3
    OUT_OF_MEMORY = 4
    BACKEND_ERROR = 5
    COMM_ERROR = 6
    TIMEOUT = 7
    IO_ERROR = 8
    CORRUPT = 9
    NOT_FOUND = 10
    REMOTE_ERROR = 11
    IN_PROGRESS = 12
    ABORTED = 13
    INTERNAL = 14


def as_status(value):
    """The Status member, or the plain int for a status this package does not know (a newer
    library may add statuses; any of them but SUCCESS is a failure)."""
    try:
        return Status(value)
    except ValueError:
        return int(value)


class LogLevel(enum.IntEnum):
    ERROR = 0
    WARN = 1
    INFO = 2
    DEBUG = 3


class DType(enum.IntEnum):
    F32 = 0
    BF16 = 1

    @property
    def itemsize(self):
        return 4 if self is DType.F32 else 2


class Device(enum.IntEnum):
    HOST = 0
    CUDA = 1


class Backend(enum.IntEnum):
    AUTO = 0
    HOST = 1
    CUDA = 2


class CommBackend(enum.IntEnum):
    AUTO = 0
    MPI = 1
    NCCL = 2


class Axis(enum.IntEnum):
    TP = 0
    EP = 1
    DP = 2
    PP = 3
    EDP = 4
    WORLD = 5


class ScoreFn(enum.IntEnum):
    SOFTMAX = 0
    SIGMOID = 1


class Placement(enum.IntEnum):
    CONTIGUOUS = 0
    ROUND_ROBIN = 1


class ParamKind(enum.IntEnum):
    DENSE = 0
    EXPERT = 1
    BUFFER = 2


class LrDecay(enum.IntEnum):
    CONSTANT = 0
    LINEAR = 1
    COSINE = 2


class CkptState(enum.IntEnum):
    IDLE = 0
    WRITING = 1
    UPLOADING = 2
    FAILED = 3


class CkptTier(enum.IntEnum):
    LOCAL = 0
    S3 = 1


class PipeOp(enum.IntEnum):
    FORWARD = 0
    BACKWARD = 1
    SEND_ACT = 2
    RECV_ACT = 3
    SEND_GRAD = 4
    RECV_GRAD = 5


class PipeIssue(enum.IntEnum):
    AUTO = 0
    PREPOST = 1
    ORDERED = 2


class ElasticPhase(enum.IntEnum):
    STARTED = 0
    RESUMED = 1
    TRAINING = 2


def to_enum(cls, value):
    """cls member for a member, its int value or its name in any case ("round_robin")."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            return cls[value.upper().replace("-", "_")]
        except KeyError:
            names = ", ".join(m.name.lower() for m in cls)
            raise ValueError(f"unknown {cls.__name__} {value!r}; expected one of {names}") from None
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown {cls.__name__} value {value}") from None
    raise TypeError(f"{cls.__name__} expected, got {type(value).__name__}")
