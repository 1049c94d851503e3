"""Argument checks shared by the launchers: each failure is a `ValueError` naming the argument."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
LOG2E = 1.4426950408889634


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
    last_contiguous: bool = True,
) -> torch.Tensor:
    """`t` is a tensor with `ndim` dimensions, one of `dtypes`, on `device`, and (unless
    `last_contiguous` is False) unit stride in its last dimension."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be one of ({names}), got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if last_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got {t.stride()}")
    return t


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(f"{name} dtype {t.dtype} must equal {ref_name} dtype {ref.dtype}")


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands multiply in full precision (TF32 would break float32 fidelity with HF);
    16-bit operands ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_index(name: str, t: object, n: int, device: torch.device) -> torch.Tensor:
    t = check_tensor(name, t, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if t.shape[0] != n:
        raise ValueError(f"{name} has {t.shape[0]} entries, expected {n} (one per request)")
    return t


def check_paged_kv(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    num_heads: int,
) -> tuple[int, int]:
    """Shared by decode and extend: returns (kv_heads, head_dim). The caches are of q's dtype,
    or both float8_e4m3fn (an fp8 KV cache, read with its scales)."""
    device = q.device
    check_tensor("k_cache", k_cache, ndim=3, device=device)
    check_tensor("v_cache", v_cache, ndim=3, device=device)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    if k_cache.dtype == torch.float8_e4m3fn:
        check_same_dtype("v_cache", v_cache, "k_cache", k_cache)
    else:
        check_same_dtype("k_cache", k_cache, "q", q)
        check_same_dtype("v_cache", v_cache, "q", q)
    _, kv_heads, head_dim = k_cache.shape
    if q.shape[-1] != head_dim:
        raise ValueError(f"q head_dim {q.shape[-1]} != k_cache head_dim {head_dim}")
    if head_dim < 16:
        raise ValueError(f"head_dim must be >= 16, got {head_dim}")
    if num_heads % kv_heads:
        raise ValueError(f"q heads ({num_heads}) must be a multiple of kv heads ({kv_heads})")
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)
    check_tensor("req_to_token", req_to_token, ndim=2, dtypes=INDEX_DTYPES, device=device)
    return kv_heads, head_dim


def check_window(window: int | None) -> int:
    if window is None:
        return 0
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window must be a positive integer or None, got {window!r}")
    return window


def cuda_device_name(index: int | None) -> str:
    """`torch.cuda.get_device_name`, asked once per device (the tuned-config tables' key);
    None is the current device."""
    return _device_name(torch.cuda.current_device() if index is None else index)


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def tuned_configs(path: Path, device_name: str) -> dict:
    """The entry of `device_name` in a tuned-configuration file (`{device name: {case key:
    config}}`, written by a benchmark's `--write-config`); {} when the file or the entry is
    absent. A file that is not such JSON raises `ValueError` naming it (hand-edited or cut
    short), not a bare decoding error at some layer's first launch."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"tuned kernel configurations {path}: not valid JSON ({e})") from e
    entry = data.get(device_name, {}) if isinstance(data, dict) else None
    if not isinstance(entry, dict):
        raise ValueError(
            f"tuned kernel configurations {path}: expected {{device name: {{case: config}}}}, "
            f"got {type(data if entry is None else entry).__name__} for {device_name!r}"
        )
    return entry
