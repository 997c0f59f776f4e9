"""A 64-bit, position-sensitive checksum of a tensor's bytes, computed on the tensor's own device.

Stored with param_grad rows (tensors.checksum) so that two ranks' final gradients compare bitwise, exactly.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

# sum over positions i of int(x_i) * m_i, modulo 2**64, where int(x_i) is element i's bytes read as a signed
# integer of the element's width (sign-extended to 64 bits) and m_i an odd multiplier that depends on i only.
# Linear in the elements, so chunks add up in any order (equal on every device and for any chunking); a change
# d != 0 at one position changes the sum by d * m_i != 0 (m_i is odd), and changes at several positions (a
# swap, +1/-1 ulp at two places) cancel only when their multipliers happen to line up (about 2**-64).
# m_i = _BLOCK_MULT[i % _CSUM_CHUNK] * K(i // _CSUM_CHUNK): one cached block of multipliers per device,
# times an odd per-block factor, so no index tensor is built per call.
_CSUM_CHUNK = 1 << 18  # elements per chunk: int64 temporaries of 2 MiB
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _signed64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _block_multipliers_numpy() -> np.ndarray:
    with np.errstate(over="ignore"):
        z = np.arange(_CSUM_CHUNK, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x632BE59BD9B4E019)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z | np.uint64(1)).view(np.int64)


_block_mult: dict[torch.device, torch.Tensor] = {}
_block_factor: list[int] = [1]  # K(0) = 1: a tensor of one chunk needs no extra multiply
_work = threading.local()  # per thread and device: one reusable int64 chunk (no allocation per chunk)


def _work_buffer(device: torch.device) -> torch.Tensor:
    bufs = getattr(_work, "bufs", None)
    if bufs is None:
        bufs = _work.bufs = {}
    b = bufs.get(device)
    if b is None:
        b = bufs[device] = torch.empty(_CSUM_CHUNK, dtype=torch.int64, device=device)
    return b


def _multipliers(device: torch.device) -> torch.Tensor:
    m = _block_mult.get(device)
    if m is None:
        cpu = _block_mult.get(torch.device("cpu"))
        if cpu is None:
            cpu = _block_mult[torch.device("cpu")] = torch.from_numpy(_block_multipliers_numpy())
        m = _block_mult[device] = cpu if device.type == "cpu" else cpu.to(device)
    return m


def _factor(k: int) -> int:
    while len(_block_factor) <= k:
        _block_factor.append(_signed64(_splitmix64(len(_block_factor) ^ 0x5851F42D4C957F2D) | 1))
    return _block_factor[k]


def _pieces(t: torch.Tensor, offset: int = 0):
    """(offset, 1-d tensor of at most _CSUM_CHUNK elements) covering t in row-major order; a non-contiguous t
    is copied one block of rows at a time."""
    n = t.numel()
    if n == 0:
        return
    if t.is_contiguous():
        flat = t.reshape(-1)
        for start in range(0, n, _CSUM_CHUNK):
            yield offset + start, flat[start : start + _CSUM_CHUNK]
        return
    rows, row = t.shape[0], n // t.shape[0]
    if row <= _CSUM_CHUNK:
        per = max(1, _CSUM_CHUNK // row)
        for start in range(0, rows, per):
            yield offset + start * row, t[start : start + per].reshape(-1)
    else:
        for i in range(rows):
            yield from _pieces(t[i], offset + i * row)


def checksum_on_device(t: torch.Tensor):
    """`checksum` as a 0-d int64 tensor on t's device (no host sync), or an int for a CPU tensor."""
    if (
        type(t) not in (torch.Tensor, torch.nn.Parameter)
        or t.layout != torch.strided
        or t.device.type == "meta"
        or t.is_quantized
    ):
        return None  # bytes not read: a subclass, sparse, meta or quantized tensor
    width = t.element_size()
    with torch.no_grad():
        x = t.detach()
        if x.is_complex():
            x = torch.view_as_real(x)
            width //= 2
        x = x.view(_INT_OF_WIDTH[width])
        mult = _multipliers(x.device)
        work = _work_buffer(x.device)
        acc = None
        for offset, piece in _pieces(x):
            while piece.numel():
                k, j = divmod(offset, _CSUM_CHUNK)
                take = min(piece.numel(), _CSUM_CHUNK - j)
                w = work[:take]
                w.copy_(piece[:take])  # sign-extends to int64
                s = w.mul_(mult[j : j + take]).sum()
                if k:
                    s = s * _factor(k)
                acc = s if acc is None else acc.add_(s)
                piece, offset = piece[take:], offset + take
    if acc is None:
        return 0
    return int(acc) if acc.device.type == "cpu" else acc


def checksum(t: torch.Tensor | None) -> int | None:
    """A 64-bit signed checksum of a tensor's bytes, in row-major (logical) order.

    Equal for bitwise-equal tensors of one dtype and shape on any device, whatever their strides; a
    different value at any one position always changes it, and changes at several positions (swapped
    elements, +1 and -1 ulp at two places) change it except with probability about 2**-64. Runs on the
    tensor's device in chunks of 2**18 elements (a few MiB of temporaries); this function reads the result
    (one host sync), the recorder leaves it on the device until the pass's transfer.

    Returns None for None, and for a tensor whose bytes are not read (a subclass, sparse, meta or quantized).
    """
    if t is None:
        return None
    c = checksum_on_device(t)
    return c if c is None or isinstance(c, int) else int(c)
