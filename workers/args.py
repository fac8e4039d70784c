"""Worker command-line arguments. Flag names follow SGLang's where SGLang has the same concept."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from dsv4_cluster.core import KERNEL_NAMES, Role


@dataclass(frozen=True)
class WorkerArgs:
    role: Role
    host: str = "127.0.0.1"
    port: int = 30100
    disaggregation_bootstrap_port: int | None = None
    served_model_name: str = "dsv4-tiny"
    model_preset: str = "tiny"          # workers/engine/presets.py: tiny (CPU) or flash (DeepSeek-V4-Flash's shapes)
    seed: int = 0
    context_length: int = 2048
    # max_new_tokens of a request that gives none (chat, /generate): SGLang's SamplingParams default.
    # Decode reserves prompt + max_new_tokens of KV, so this, not the context, sizes such a reservation.
    default_max_tokens: int = 128
    # prompt tokens one prefill step computes, over one or more prompts (SGLang's flag of that name)
    chunked_prefill_size: int = 1024
    page_size: int = 16
    # auto: float32 on cpu; on cuda SGLang's fp8 V4 layout for the flash preset, bf16 rows for tiny. fp8_e4m3
    # (flash only), bf16 (cuda), float32 (cpu): presets.kv_layout_dtype
    kv_cache_dtype: str = "auto"
    max_total_tokens: int = 16384
    transfer_backend: str = "nixl"
    device: str = "cpu"
    node_address: str = "127.0.0.1"
    ucx_tls: str | None = None
    kernels: str = ""
    cuda_graph_max_bs: int = 64       # decode batches up to this size replay CUDA graphs (SGLang's flag)
    disable_cuda_graph: bool = False  # decode every batch eagerly (SGLang's flag)
    peer_timeout_s: float = 30.0
    transfer_timeout_s: float = 60.0
    disable_radix_cache: bool = False  # prefill: no prefix cache (SGLang's flag); every prompt computed in full
    write_timeout_s: float = 30.0     # prefill: a KV WRITE still in flight this long is cancelled (transfer.write_timeout_s)
    # an engine loop that does not come round for this long fails its requests (503) and /health (liveness.py)
    stall_timeout_s: float = 5.0
    log_level: str = "info"
    test_hooks: bool = False   # TEST ONLY: serve POST /debug/kill_engine and /debug/stall_engine (fault tests)
    test_start_delay_s: float = 0.0   # TEST ONLY: wait this long before starting (a window for `down` during `up`)

    @property
    def kernel_list(self) -> tuple[str, ...]:
        return tuple(k for k in self.kernels.split(",") if k)


def parse_args(role: Role | str, argv: list[str] | None = None) -> WorkerArgs:
    role = Role(role)
    parser = argparse.ArgumentParser(prog=f"python -m dsv4_cluster.workers.{role}",
                                     description=f"Embedded DeepSeek-V4-shaped {role} worker")
    for f in dataclasses.fields(WorkerArgs):
        if f.name == "role" or (f.name == "disaggregation_bootstrap_port" and role is Role.DECODE):
            continue
        flag = "--" + f.name.replace("_", "-")
        if str(f.type) == "bool":
            parser.add_argument(flag, action="store_true", help=f"(default: {f.default})")
            continue
        kind = {"int": int, "float": float, "int | None": int, "str | None": str}.get(str(f.type), str)
        parser.add_argument(flag, type=kind, default=f.default, help=f"(default: {f.default})")
    ns = vars(parser.parse_args(argv))
    args = WorkerArgs(role=role, **ns)
    problems = validate(args)
    if problems:
        parser.error("; ".join(problems))
    return args


def validate(args: WorkerArgs) -> list[str]:
    problems = []
    if args.role is Role.PREFILL and not args.disaggregation_bootstrap_port:
        problems.append("--disaggregation-bootstrap-port is required for a prefill worker")
    if args.transfer_backend != "nixl":
        problems.append(f"--transfer-backend {args.transfer_backend!r}: the embedded engine implements only "
                        "'nixl' (no silent fallback); use nixl")
    problems += _device_problems(args)
    if args.page_size <= 0 or args.page_size % 4:
        problems.append(f"--page-size {args.page_size}: must be a positive multiple of 4 (the compression ratio)")
    if args.chunked_prefill_size < 1:
        problems.append(f"--chunked-prefill-size {args.chunked_prefill_size}: must be at least 1")
    if args.write_timeout_s <= 0:
        problems.append(f"--write-timeout-s {args.write_timeout_s}: must be positive")
    if args.stall_timeout_s <= 0:
        problems.append(f"--stall-timeout-s {args.stall_timeout_s}: must be positive")
    if args.default_max_tokens < 1:
        problems.append(f"--default-max-tokens {args.default_max_tokens}: must be at least 1")
    held = args.max_total_tokens // args.page_size * args.page_size if args.page_size > 0 else 0   # whole pages
    if args.max_total_tokens < args.context_length:
        problems.append(f"--max-total-tokens {args.max_total_tokens} is smaller than --context-length "
                        f"{args.context_length}: one full-length request could never fit")
    elif 0 < held < args.context_length:
        problems.append(f"--max-total-tokens {args.max_total_tokens}: its whole pages of {args.page_size} tokens hold "
                        f"{held}, fewer than --context-length {args.context_length}: one full-length request could "
                        "never fit (its decode leg would wait forever); round it up to a whole page")
    unknown = [k for k in args.kernel_list if k not in KERNEL_NAMES]
    if unknown:
        problems.append(f"--kernels: unknown {unknown}; choose from {', '.join(KERNEL_NAMES)}")
    return problems


def _device_problems(args: WorkerArgs) -> list[str]:
    from .engine.presets import PRESETS

    problems = []
    if args.model_preset not in PRESETS:
        problems.append(f"--model-preset {args.model_preset!r}: choose from {', '.join(PRESETS)}")
    cfg = PRESETS.get(args.model_preset)
    kind, _, index = args.device.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        problems.append(f"--device {args.device!r}: the embedded engine runs on cpu, cuda or cuda:N (GPU N of those "
                        "this process sees)")
    elif kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            problems.append(f"--device {args.device}: this machine has no CUDA device torch can use; use --device cpu")
        elif index and int(index) >= torch.cuda.device_count():
            problems.append(f"--device {args.device}: this process sees {torch.cuda.device_count()} GPU(s) "
                            f"(0-{torch.cuda.device_count() - 1}); check the GPU index and CUDA_VISIBLE_DEVICES")
        if cfg is not None and args.kernel_list and (cfg.head_dim != 512 or cfg.n_heads not in (16, 32, 64)):
            problems.append(f"--device cuda --kernels: the {args.model_preset!r} preset's shapes ({cfg.n_heads} "
                            f"heads x {cfg.head_dim} dims) are not what the kernels take (512 dims, 16/32/64 "
                            "heads); use --model-preset flash, or no --kernels (reference ops on the GPU)")
    if cfg is not None and args.page_size > 0:
        problems += _kv_problems(args, cfg)
    if args.cuda_graph_max_bs < 0:
        problems.append(f"--cuda-graph-max-bs {args.cuda_graph_max_bs}: must be >= 0 (0: no graphs)")
    return problems


def _kv_problems(args: WorkerArgs, cfg) -> list[str]:
    """--kv-cache-dtype and --page-size against the preset's KV layout (`kv.layout.PoolLayout.problems`)."""
    from .engine.presets import KVDtypeError, kv_layout_dtype, pool_layout

    try:
        dtype = kv_layout_dtype(args.kv_cache_dtype, cfg, args.device)
    except KVDtypeError as exc:
        return [str(exc)]
    return [f"--page-size {args.page_size} / --kv-cache-dtype {args.kv_cache_dtype} with the {args.model_preset!r} "
            f"preset: {p}" for p in pool_layout(cfg, dtype, args.page_size, 1).problems()]
