"""ctypes mirrors of the public structs of include/moe/*.h, field for field and in order.

C enums are ints on every ABI libmoe supports. tests/python/test_layout.py compiles a C program
that prints sizeof and offsetof of every struct and field named here and compares them with
these layouts, so a header change that is not mirrored here fails CI.
"""
import ctypes as C

MAX_DIMS = 4
enum_t = C.c_int
status_t = C.c_int
Dims = C.c_int64 * MAX_DIMS

LOG_FN = C.CFUNCTYPE(None, enum_t, C.c_char_p, C.c_void_p)
# moe_elastic_orphan_fn(user, why)
ORPHAN_FN = C.CFUNCTYPE(None, C.c_void_p, C.c_char_p)


class Tensor(C.Structure):
    _fields_ = [("data", C.c_void_p), ("dtype", enum_t), ("ndim", C.c_int32), ("shape", Dims),
                ("device", enum_t), ("device_index", C.c_int32)]


class MeshConfig(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("tp", C.c_int32), ("ep", C.c_int32),
                ("dp", C.c_int32), ("pp", C.c_int32), ("rank_order", C.c_char_p),
                ("comm", enum_t), ("mpi_comm", C.c_void_p), ("timeout_ms", C.c_int32)]


class RuntimeConfig(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("backend", enum_t), ("device_index", C.c_int32),
                ("deterministic", C.c_int32), ("seed", C.c_uint64), ("log_level", enum_t),
                ("log_fn", LOG_FN), ("log_user_data", C.c_void_p),
                ("mesh", C.POINTER(MeshConfig))]


class LayerConfig(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("hidden", C.c_int64), ("ffn_hidden", C.c_int64),
                ("num_experts", C.c_int32), ("top_k", C.c_int32), ("score_fn", enum_t),
                ("renormalize", C.c_int32), ("capacity_factor", C.c_float),
                ("aux_loss_coef", C.c_float), ("z_loss_coef", C.c_float),
                ("expert_bias", C.c_int32), ("expert_bias_rate", C.c_float),
                ("max_microbatches", C.c_int32), ("placement", enum_t),
                ("a2a_chunks", C.c_int32), ("init_std", C.c_float),
                ("aux_global_batch", C.c_int32)]


class ParamInfo(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("name", C.c_char_p), ("kind", enum_t),
                ("value", Tensor), ("grad", Tensor), ("global_shape", Dims),
                ("shard_offset", Dims), ("expert_dim", C.c_int32), ("tp_dim", C.c_int32)]


class LayerStats(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("tokens", C.c_int64), ("slots", C.c_int64),
                ("dropped_slots", C.c_int64), ("dropped_ratio", C.c_double),
                ("max_load", C.c_double), ("mean_load", C.c_double), ("entropy", C.c_double),
                ("aux_loss", C.c_double), ("z_loss", C.c_double), ("capacity", C.c_int64)]


class AdamWConfig(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("lr", C.c_float), ("beta1", C.c_float),
                ("beta2", C.c_float), ("eps", C.c_float), ("weight_decay", C.c_float)]


class LrSchedule(C.Structure):
    _fields_ = [("decay", enum_t), ("warmup_steps", C.c_int64), ("decay_steps", C.c_int64),
                ("min_lr_ratio", C.c_float)]


class CkptConfig(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("dir", C.c_char_p), ("keep_last", C.c_int32),
                ("chunk_bytes", C.c_size_t), ("pinned_budget_bytes", C.c_size_t),
                ("queue_depth", C.c_int32), ("io_block_bytes", C.c_size_t),
                ("use_direct_io", C.c_int32), ("s3_endpoint", C.c_char_p),
                ("s3_bucket", C.c_char_p), ("s3_prefix", C.c_char_p),
                ("s3_region", C.c_char_p), ("s3_access_key", C.c_char_p),
                ("s3_secret_key", C.c_char_p), ("s3_session_token", C.c_char_p),
                ("s3_part_bytes", C.c_size_t), ("s3_parallel_parts", C.c_int32),
                ("s3_max_retries", C.c_int32), ("s3_retry_base_ms", C.c_int32),
                ("s3_timeout_ms", C.c_int32), ("s3_retry_max_ms", C.c_int32)]


class CkptTensor(C.Structure):
    _fields_ = [("name", C.c_char_p), ("tensor", Tensor), ("global_shape", Dims),
                ("offset", Dims), ("expert_dim", C.c_int32),
                ("expert_ids", C.POINTER(C.c_int32))]


class CkptStatus(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("state", enum_t),
                ("last_committed_step", C.c_int64), ("last_uploaded_step", C.c_int64),
                ("pending_saves", C.c_int64), ("pending_uploads", C.c_int64),
                ("bytes_written", C.c_uint64), ("bytes_uploaded", C.c_uint64),
                ("last_stall_s", C.c_double), ("last_durable_s", C.c_double),
                ("direct_io", C.c_int32), ("uploads_superseded", C.c_int64),
                ("upload_failures", C.c_int64), ("last_upload_error", status_t)]


class PipelineAction(C.Structure):
    _fields_ = [("op", enum_t), ("microbatch", C.c_int32), ("peer", C.c_int32),
                ("chunk", C.c_int32)]


TENSOR_P = C.POINTER(Tensor)
FORWARD_FN = C.CFUNCTYPE(status_t, C.c_void_p, C.c_int32, C.c_int32, TENSOR_P, TENSOR_P)
LOSS_FN = C.CFUNCTYPE(status_t, C.c_void_p, C.c_int32, TENSOR_P, TENSOR_P,
                      C.POINTER(C.c_double))
BACKWARD_FN = FORWARD_FN
ZERO_GRAD_FN = C.CFUNCTYPE(status_t, C.c_void_p)
STEP_FN = C.CFUNCTYPE(status_t, C.c_void_p, C.c_float)
ABANDON_FN = C.CFUNCTYPE(status_t, C.c_void_p, C.c_int32, C.c_int32)


class PipelineCallbacks(C.Structure):
    _fields_ = [("forward", FORWARD_FN), ("loss", LOSS_FN), ("backward", BACKWARD_FN),
                ("zero_grad", ZERO_GRAD_FN), ("step", STEP_FN), ("abandon", ABANDON_FN),
                ("user", C.c_void_p)]


class PipelineConfig(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("microbatches", C.c_int32),
                ("act_ndim", C.c_int32), ("act_shape", Dims), ("act_dtype", enum_t),
                ("prepost", C.c_int32), ("optimizer", C.c_void_p), ("lr", C.c_float),
                ("grad_scale", C.c_float), ("timeout_ms", C.c_int32),
                ("virtual_stages", C.c_int32), ("issue", enum_t)]


class PipelineStats(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("schedule_seconds", C.c_double),
                ("compute_seconds", C.c_double), ("wait_seconds", C.c_double),
                ("stage", C.c_int32), ("stages", C.c_int32), ("microbatches", C.c_int32),
                ("buffers", C.c_int32)]


class RuntimeWaitStats(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("wait_seconds", C.c_double),
                ("waits", C.c_int64)]


class ElasticMemberConfig(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("endpoint", C.c_char_p), ("prefix", C.c_char_p),
                ("slot", C.c_int32), ("rank", C.c_int32), ("ttl_ms", C.c_int32),
                ("request_timeout_ms", C.c_int32)]


# C type name -> mirror, for the layout test
C_NAMES = {
    "moe_tensor_t": Tensor, "moe_mesh_config_t": MeshConfig,
    "moe_runtime_config_t": RuntimeConfig, "moe_runtime_wait_stats_t": RuntimeWaitStats,
    "moe_layer_config_t": LayerConfig,
    "moe_param_info_t": ParamInfo, "moe_layer_stats_t": LayerStats,
    "moe_adamw_config_t": AdamWConfig, "moe_lr_schedule_t": LrSchedule,
    "moe_ckpt_config_t": CkptConfig,
    "moe_ckpt_tensor_t": CkptTensor, "moe_ckpt_status_t": CkptStatus,
    "moe_pipeline_action_t": PipelineAction, "moe_pipeline_callbacks_t": PipelineCallbacks,
    "moe_pipeline_config_t": PipelineConfig, "moe_pipeline_stats_t": PipelineStats,
    "moe_elastic_member_config_t": ElasticMemberConfig,
}
