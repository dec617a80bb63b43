"""Weight-only quantization of linear layers at load (`--quantization int8|int4`): weights
stored in 8 or 4 bits with fp32 (int8) or bf16 (int4) scales (GGUF files: fp32, or Q4_0's fp16);
activations rounded to int8 per block of 32 where they meet them (GGUF Q8_0's scheme, as
llama.cpp does); adapters in the model's dtype.

Semantics (the native kernel vllm/csrc/cpu/quant_linear.cpp computes the same):
    int8: per output channel (group = K): q = round(W / s) in [-127, 127], s = max|W[n]| / 127
    int4: groups of `INT4_GROUP` (32, GGUF Q4_0's block) input features per output channel:
          q = round(W / s) in [-8, 7] (clamped), s = W[n, j*] / -8 rounded to bf16, W[n, j*] the
          group's element of largest magnitude (GGUF Q4_0's rule: it maps to -8 up to that
          rounding, its sign in s, so all 16 levels are used: 12% less weight error than
          max|W| / 7 on 15 levels, SmolLM2's and Gaussian weights; a scale is 2 bytes per 16 of
          weights, as GGUF Q4_0's fp16 d, instead of 4: 10% fewer bytes a decode reads, and
          bf16 keeps fp32's range); stored as q + 8, two per byte: in each block of 32, byte j
          holds element j (low nibble) and element j + 16 (high nibble). A weight whose every group
          already lies on a 16-level grid (within `GRID_TOLERANCE` of its largest magnitude: a
          checkpoint dequantized from 4 bits, as the packaged default model is from GGUF Q4_1) keeps
          that grid instead of being rounded onto this one, which cannot hold it: s = (max - min) / 15
          and m = min in fp16, q = round((W - m) / s) - 8, offset m + 8s (fp16 mins, below): Q4_1's
          own tensors where it came from Q4_1 (20 bytes per 32 weights instead of 18)
    W' = s * q; a quantized layer computes x' @ W'.T + bias, where x' is x (in fp32) rounded per
    row and block of `ACT_BLOCK` (32) input features, the last block possibly shorter:
          xs = max|x[block]| / 127, xq = round(x * (1 / xs)) in [-127, 127] (1 / xs = 0 for an
          all-zero block; fp32 ops, round half to even), x' = xs * xq
    so the native kernel runs integer dot products (int8 x int8/int4, summed per block and weight
    group, each such sum scaled once in fp32). `reference_linear` computes it in float64.
    offsets (optional, fp32 [N, K / group]): W' = s * q + offset of the element's group; or GGUF
          Q4_1's fp16 mins m beside fp16 scales (int4): offset = m + 8s, formed in fp32. GGUF's Q4_K
          (w = d*sc*q - dmin*m) is int4 with s = d*sc and offset 8s - dmin*m, kept in the file's
          two-level form (`superblocks`: d, dmin per 256; 6-bit sc, m per group as bytes: 0.59
          bytes a weight instead of 0.75 with fp32 s and offsets); GGUF's Q6_K likewise keeps d
          per 256 and its int8 sc per 16. The int4 kernel adds the offsets' share itself, x' @ W'.T
          = x' @ (s*q).T + (x' summed per group) @ offsets.T: inside its paired loop (per superblock
          for Q4_K; Q4_1's as s * stored nibble + m), after a row's integer sums on its other paths.

Invariants:
  - `reference_linear` (x' @ dequantize().T in float64) is the reference: the native kernel and
    the torch path both equal it up to fp32 rounding. Every path rounds the activations, so a
    prompt scored in one prefill and token by token in decodes sees the same numerics.
  - Up to `native_max_rows(weight)` rows (decodes, batches of them, short chunks) run the native
    kernel, which reads every weight byte once per call and multiplies integers; more rows
    (prefills) dequantize tiles of `TILE_ROWS` output channels and run a dense fp32 matmul
    (`dense_gemv.fp32_linear`), which wins once there are enough rows to spread the dequantizing
    over; x' comes from the extension's one-pass `round_activations`, bitwise equal to
    `round_activations` here. Without the native kernel every call takes the tiled torch path.
  - Where the native kernel has them (AVX512-VNNI), a layer's weight with a multiple of 16 rows is
    held in row tiles (`tile`; which formats in `_tileable`: int4 and int8 at load, GGUF Q4_0, Q4_1,
    Q4_K, Q6_K and Q8_0; layouts and semantics in vllm/csrc/cpu/quant_tiles.h): the same bytes, moved so one
    instruction serves 16 rows. Everything else reads it through `untile` (its exact inverse):
    slicing, dequantizing.
  - Only the base weights are quantized: LoRA slots and the embedding's lookup table stay in the
    model's dtype. The LM head is quantized too, per output channel int8 under both methods
    (as llama.cpp keeps its output matrix at 6-8 bits): layers/vocab_embedding.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from vllm import native_build
from vllm.model_executor.layers.dense_gemv import fp32_linear

METHODS = ("int8", "int4")
INT4_GROUP = 32
ROW_TILE = 16  # weight rows per row tile (vllm/csrc/cpu/quant_tiles.h's kTileRows)
KQUANT_SUPERBLOCK = 256  # weights per GGUF K-quant superblock (d, dmin)
Q6_K_GROUP = 16  # weights per GGUF Q6_K sub-scale sc
Q6_K_OFFSET = 32  # GGUF Q6_K stores q + 32 (0..63); its row tiles hold that, the row layout q (-32..31)
ACT_BLOCK = 32  # input features per activation scale
TILE_ROWS = 1024  # output channels dequantized at once on the dense path (bounds the temporary)
# Rows of x up to which the native kernel runs, by weight format: where it took less time than the
# tiled torch path, which dequantizes every weight per call (two Zen 4 threads, bf16 x, SmolLM2's
# and Granite-3.3-2B's shapes; the larger the weight, the more a call's dequantizing costs). int4
# (this file's, GGUF Q4_0 and Q4_K; two rows of x a pass, rows in L2-sized chunks): 0.34-0.80x the
# time at 512 rows, 0.49-0.93x at 2048. int8 per output channel: 0.33-0.95x at 256, 0.49-1.08x at
# 512. int8 in groups (GGUF Q8_0, Q6_K: a scale per 16 or 32 weights to apply per row of x):
# 0.18-0.99x at 64, 0.36-0.96x at 128, 0.57-1.55x at 256.
NATIVE_MAX_ROWS_INT4 = 2048
# Weights in row tiles (`tile`): any number of rows. int4 took 0.31-0.41x the tiled torch path's time at
# 2,048-8,192 rows (one Zen 4 thread; SmolLM2's 3072 x 576 and 576 x 1536, Granite-3.3-2B's 2048 x 2048
# and 16384 x 2048), its time growing with the rows.
NATIVE_MAX_ROWS_TILES = 1 << 20
NATIVE_MAX_ROWS_INT8 = 256
NATIVE_MAX_ROWS_INT8_GROUPED = 64
# How far (relative to a group's largest magnitude) a group may lie from its min-max 4-bit grid and
# still count as on it: bf16 rounding moves a weight by at most 2^-9 of it, while a group not on
# such a grid lies up to half a step (1/30 of its range) away.
GRID_TOLERANCE = 2 ** -6
GRID_PROBE_ROWS = 8  # rows checked first: a weight off the grid is told from them
_SOURCE, _WHAT = "quant_linear.cpp", "CPU quantized-linear kernel"


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    method: str  # "int8" | "int4"
    qweight: torch.Tensor  # int8 [N, K] or uint8 [N, K / 2]
    scales: torch.Tensor  # fp32, bf16 (int4 at load) or fp16 (GGUF Q4_0) [N, K / group]; uint8 sc with superblocks
    group: int
    in_features: int
    # fp32 [N, K / group], added to every weight of its group; fp16 Q4_1 mins m (offset m + 8 * scale; rows
    # beside the scales' rows: q4_1_scales_and_mins); uint8 m
    offsets: Optional[torch.Tensor] = None
    # GGUF K-quants' two-level form, as the file keeps it, per superblock of 256 weights. Q4_K:
    # fp32 [N, K / 256, 2], d and dmin; scales and offsets hold the groups' 6-bit sc and m (uint8);
    # a group's scale is d * sc (exact), its offset 8 * d * sc - dmin * m (rounded once). Q6_K
    # (int8, groups of 16): fp32 [N, K / 256, 1], d; scales the groups' int8 sc; scale d * sc.
    superblocks: Optional[torch.Tensor] = None
    # in row tiles (`tile`): qweight [N / 16, K / 32, 256 (int4) or 512 (int8)], scales (and mins) [N / 16, G, 16]
    tiled: bool = False

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0] * (ROW_TILE if self.tiled else 1)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors it holds (qweight, scales, and offsets and superblocks where it has them)."""
        return [t for t in (self.qweight, self.scales, self.offsets, self.superblocks) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def rows(self, index) -> "QuantizedWeight":
        """The weight of the output rows `index` (a slice or an index tensor) selects, in the row layout."""
        if self.tiled:
            return untile(self).rows(index)
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return QuantizedWeight(self.method, self.qweight[index], self.scales[index], self.group, self.in_features,
                               pick(self.offsets), pick(self.superblocks))

    def _per_group(self, t: torch.Tensor) -> torch.Tensor:  # [N, K / 256] -> [N, K / group]
        return t.repeat_interleave(KQUANT_SUPERBLOCK // self.group, dim=1)

    def group_scales(self) -> torch.Tensor:  # fp32 [N, K / group]
        if self.tiled:
            return untile(self).group_scales()
        if self.superblocks is None:
            return self.scales.float()
        return self._per_group(self.superblocks[..., 0]) * self.scales.float()

    def group_offsets(self) -> Optional[torch.Tensor]:  # fp32 [N, K / group], or None
        if self.tiled:
            return untile(self).group_offsets()
        if self.offsets is not None and self.offsets.dtype == torch.float16:  # Q4_1's mins
            return self.offsets.float() + 8 * self.scales.float()
        if self.superblocks is None or self.offsets is None:
            return self.offsets
        return 8 * self.group_scales() - self._per_group(self.superblocks[..., 1]) * self.offsets.float()

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:  # fp32 [N, K] (or the rows asked for)
        if self.tiled:  # only the tiles the rows lie in back to the row layout
            start, stop, _ = rows.indices(self.out_features)
            first, last = start // ROW_TILE, -(-stop // ROW_TILE)
            pick = lambda t: None if t is None else t[first:last]  # noqa: E731
            tiles = QuantizedWeight(self.method, self.qweight[first:last], self.scales[first:last], self.group,
                                    self.in_features, pick(self.offsets), pick(self.superblocks), tiled=True)
            return untile(tiles).dequantize(slice(start - first * ROW_TILE, stop - first * ROW_TILE))
        part = self.rows(rows)
        q = part.qweight
        if self.method == "int4":
            blocks = q.view(q.shape[0], -1, INT4_GROUP // 2)  # [n, K / 32, 16] bytes
            low = (blocks & 0x0F).to(torch.int8) - 8
            high = (blocks >> 4).to(torch.int8) - 8
            q = torch.cat([low, high], dim=-1).view(q.shape[0], self.in_features)
        w = q.float() * part.group_scales().repeat_interleave(self.group, dim=1)
        offsets = part.group_offsets()
        return w if offsets is None else w + offsets.repeat_interleave(self.group, dim=1)


def q4_1_scales_and_mins(scales: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and mins [..., R, C] (rows [N, G]; row tiles [T, G, 16]) -> the same values as views of
    one [..., R, 2, C] tensor, each row's (or block's) scales beside its mins: one memory stream for
    the kernel, where two separate arrays made a Q4_1 decode's linears 1.2x the time of symmetric
    int4's for 1.11x the bytes (SmolLM2's shapes, one Zen 4 thread, cold); side by side 1.0-1.1x."""
    both = torch.stack([scales, mins], dim=-2)  # [..., R, 2, C]
    return both[..., 0, :], both[..., 1, :]


def stack_rows(weights: list[QuantizedWeight]) -> Optional[QuantizedWeight]:
    """The weights' rows one after another, as one weight (a fused layer's slices stored apart, as
    GGUF files store q/k/v and gate/up), or None where they differ in method, group, input size,
    scale or offset dtype or in having offsets or superblocks. Each output row is computed from its
    own row alone, so the stacked weight's product equals the slices' products side by side, bit for
    bit, in one call. Tiled weights are stacked in the row layout (`tile` the result to tile it)."""
    weights = [untile(w) if w.tiled else w for w in weights]
    first = weights[0]
    shape = lambda w: (w.method, w.group, w.in_features, w.scales.dtype,  # noqa: E731
                       None if w.offsets is None else w.offsets.dtype, w.superblocks is None)
    if any(shape(w) != shape(first) for w in weights):
        return None
    cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
    scales, offsets = cat([w.scales for w in weights]), cat([w.offsets for w in weights])
    if offsets is not None and offsets.dtype == torch.float16:
        scales, offsets = q4_1_scales_and_mins(scales, offsets)
    return QuantizedWeight(first.method, cat([w.qweight for w in weights]), scales, first.group, first.in_features,
                           offsets, cat([w.superblocks for w in weights]))


def tile_rows() -> int:
    """Rows per tile of the native kernel's row tiles (vllm/csrc/cpu/quant_tiles.h), or 0 where it has
    none (no AVX512-VNNI, no native kernel)."""
    if not native_available():
        return 0
    return torch.ops.vllm_quant.tile_rows()


def _tileable(weight: QuantizedWeight) -> bool:
    """Whether the kernel's row tiles hold `weight` (quant_tiles.h): a multiple of 16 rows; int4 in groups
    of 32 with bf16 or fp16 scales (at load, GGUF Q4_0), fp16 scales and Q4_1's fp16 mins, or GGUF Q4_K's
    two-level form; int8 per output channel with fp32 scales (at load), in groups of 32 with fp32 or
    fp16 scales (GGUF Q8_0), K a multiple of 32, or GGUF Q6_K's two-level form."""
    if weight.tiled or weight.out_features % ROW_TILE:
        return False
    scales, mins = weight.scales.dtype, weight.offsets
    if weight.superblocks is not None:  # GGUF Q4_K (int4) and Q6_K (int8, groups of 16), K a multiple of 256
        return weight.method == "int4" or weight.group == Q6_K_GROUP
    if weight.method == "int4":
        return weight.group == INT4_GROUP and scales in (torch.bfloat16, torch.float16) and (
            mins is None or (mins.dtype == torch.float16 and scales == torch.float16))
    k = weight.in_features
    return k % ACT_BLOCK == 0 and ((weight.group == k and scales == torch.float32)
                                   or (weight.group == ACT_BLOCK and scales in (torch.float32, torch.float16)))


def tile(weight: QuantizedWeight) -> QuantizedWeight:
    """`weight` laid out in the native kernel's row tiles (quant_tiles.h states the layouts: 16 rows
    interleaved per block of 32 features) where the kernel has them and `_tileable` says it holds the
    weight; else `weight` as it is. The same bytes, moved: `untile` is its exact inverse."""
    if tile_rows() != ROW_TILE or not _tileable(weight):
        return weight
    t, b, g = weight.out_features // ROW_TILE, weight.in_features // ACT_BLOCK, weight.scales.shape[1]
    chunks = 4 if weight.method == "int4" else 8  # of 4 bytes per row and block
    # byte 4c + j of a row's block -> chunk c, lane 4r + j of its tile's block
    qweight = weight.qweight.view(t, ROW_TILE, b, chunks, 4).permute(0, 2, 3, 1, 4).reshape(t, b, 64 * chunks)
    per_tile = lambda s: s.view(t, ROW_TILE, g).permute(0, 2, 1)  # noqa: E731  [T, G, 16]
    if weight.offsets is None:
        if weight.superblocks is not None:  # Q6_K: the file's unsigned values q + 32 (quant_tiles.h)
            qweight = qweight + Q6_K_OFFSET
        return QuantizedWeight(weight.method, qweight.contiguous(), per_tile(weight.scales).contiguous(), weight.group,
                               weight.in_features, superblocks=_tile_superblocks(weight), tiled=True)
    scales, mins = q4_1_scales_and_mins(per_tile(weight.scales), per_tile(weight.offsets))  # [T, B, 2, 16]
    return QuantizedWeight("int4", qweight.contiguous(), scales, INT4_GROUP, weight.in_features, mins,
                           _tile_superblocks(weight), tiled=True)


def _tile_superblocks(weight: QuantizedWeight) -> Optional[torch.Tensor]:
    """A K-quant's superblocks [N, K / 256, w] as [N / 16, K / 256, w, 16] (Q4_K's d and dmin, w = 2;
    Q6_K's d, w = 1): each value's 16 rows side by side."""
    if weight.superblocks is None:
        return None
    n, per_row, w = weight.superblocks.shape
    return weight.superblocks.view(n // ROW_TILE, ROW_TILE, per_row, w).permute(0, 2, 3, 1).contiguous()


def untile(weight: QuantizedWeight) -> QuantizedWeight:
    """A tiled weight back in the row layout (`tile`'s inverse, bit for bit)."""
    t, b = weight.qweight.shape[:2]
    n, g, chunks = t * ROW_TILE, weight.scales.shape[1], 4 if weight.method == "int4" else 8
    qweight = weight.qweight.view(t, b, chunks, ROW_TILE, 4).permute(0, 3, 1, 2, 4).reshape(n, b * 4 * chunks)
    per_row = lambda s: s.permute(0, 2, 1).reshape(n, g)  # noqa: E731
    scales, mins = per_row(weight.scales), None if weight.offsets is None else per_row(weight.offsets)
    if weight.superblocks is not None:  # Q4_K's sc and m stay apart; Q6_K has no mins and holds q + 32
        _, per_row_supers, w, _ = weight.superblocks.shape
        supers = weight.superblocks.permute(0, 3, 1, 2).reshape(n, per_row_supers, w)
        if weight.method == "int8":
            qweight = qweight - Q6_K_OFFSET
        return QuantizedWeight(weight.method, qweight.contiguous(), scales.contiguous(), weight.group,
                               weight.in_features, None if mins is None else mins.contiguous(), supers.contiguous())
    if mins is not None:
        scales, mins = q4_1_scales_and_mins(scales, mins)
    return QuantizedWeight(weight.method, qweight.contiguous(), scales.contiguous(), weight.group, weight.in_features,
                           mins)


def quantize(weight: torch.Tensor, method: str) -> QuantizedWeight:
    """weight: [N, K] floating. Round to nearest, symmetric, or for int4 keep the 4-bit grid the weight
    already lies on, as the module docstring states."""
    if method not in METHODS:
        raise ValueError(f"Unknown quantization {method!r}; supported: {', '.join(METHODS)}.")
    n, k = weight.shape
    w = weight.detach().float()
    if method == "int8":
        scales = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # [N, 1]
        q = torch.round(w / scales).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight("int8", q.contiguous(), scales.contiguous(), k, k)
    if k % INT4_GROUP:
        raise ValueError(f"int4 quantization needs input sizes that are multiples of {INT4_GROUP}, got {k}.")
    groups = w.view(n, k // INT4_GROUP, INT4_GROUP)
    # A full-precision checkpoint's weight is told from a few rows, without the whole weight's temporaries.
    on_grid = _grid_int4(groups) if _grid_int4(groups[:GRID_PROBE_ROWS]) is not None else None
    if on_grid is not None:
        q, scales, offsets = on_grid
        return QuantizedWeight("int4", _pack_int4(q), scales, INT4_GROUP, k, offsets)
    largest = groups.gather(2, groups.abs().argmax(dim=2, keepdim=True))  # [N, K / 32, 1], signed
    scales = (largest / -8).to(torch.bfloat16)
    step = scales.float()
    q = torch.round(groups / torch.where(step != 0, step, 1)).clamp(-8, 7) + 8  # an all-zero group: 0 * 0
    return QuantizedWeight("int4", _pack_int4(q), scales.squeeze(2).contiguous(), INT4_GROUP, k)


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q: [N, K / 32, 32] in 0..15 (floating or integer) -> uint8 [N, K / 2], byte j of a block holding
    element j in its low nibble and element j + 16 in its high one."""
    q = q.to(torch.int16)
    half = INT4_GROUP // 2
    return (q[..., :half] | (q[..., half:] << 4)).to(torch.uint8).view(q.shape[0], -1).contiguous()


def _grid_int4(groups: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """groups: fp32 [N, K / 32, 32] -> (q in 0..15, fp16 scales, fp16 mins), each [N, K / 32(, 32)],
    where every group lies on its min-max 16-level grid (module docstring), else None. The scales
    and mins side by side (q4_1_scales_and_mins)."""
    low, high = groups.amin(dim=2), groups.amax(dim=2)  # [N, G]
    scales, mins = ((high - low) / 15).to(torch.float16), low.to(torch.float16)
    step, start = scales.float(), mins.float()
    if not (torch.isfinite(step).all() and torch.isfinite(start).all()):
        return None
    q = torch.round((groups - start[..., None]) / torch.where(step > 0, step, 1)[..., None]).clamp(0, 15)
    error = (step[..., None] * q + start[..., None] - groups).abs().amax(dim=2)  # [N, G]
    if (error > GRID_TOLERANCE * groups.abs().amax(dim=2)).any():
        return None
    return (q, *q4_1_scales_and_mins(scales, mins))


def native_available() -> bool:
    return native_build.unavailable_reason(_SOURCE, _WHAT) is None


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (xq int8 [M, K], xs fp32 [M, ceil(K / ACT_BLOCK)]), as the module docstring states."""
    m, k = x.shape
    blocks = F.pad(x.float(), (0, -k % ACT_BLOCK)).view(m, -1, ACT_BLOCK)  # zeros leave max|x| as is
    xs = blocks.abs().amax(dim=2) / 127  # [M, blocks]
    inv = torch.where(xs > 0, 1 / xs, torch.zeros_like(xs))
    xq = torch.round(blocks * inv[..., None]).clamp(-127, 127).to(torch.int8).view(m, -1)[:, :k]
    return xq, xs


def round_activations(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x' = xs * xq in `dtype` (fp32: rounded once more, by at most half an fp32 ulp): [M, K]."""
    xq, xs = quantize_activations(x)
    return xq.to(dtype) * xs.to(dtype).repeat_interleave(ACT_BLOCK, dim=1)[:, :x.shape[1]]


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """round_activations(x) for fp32 contiguous x, in one native pass where the kernel is built."""
    if x.device.type == "cpu" and native_available():
        out = torch.empty_like(x)
        torch.ops.vllm_quant.round_activations(out, x)
        return out
    return round_activations(x)


def reference_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """What a quantized layer computes without bias, in float64 (the integer sums are exact there),
    returned as fp32 [M, N]: the reference the native kernel and the torch path are tested against."""
    return (round_activations(x, torch.float64) @ weight.dequantize().double().T).float()


KERNEL_IO_DTYPES = (torch.float32, torch.bfloat16)  # x and out dtypes the kernel takes as they are


def native_max_rows(weight: QuantizedWeight) -> int:
    """Rows of x up to which `weight`'s products run the native kernel (NATIVE_MAX_ROWS_*)."""
    if weight.tiled:
        return NATIVE_MAX_ROWS_TILES
    if weight.method == "int4":
        return NATIVE_MAX_ROWS_INT4
    return NATIVE_MAX_ROWS_INT8 if weight.group == weight.in_features else NATIVE_MAX_ROWS_INT8_GROUPED


def _runs_native(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    return x.is_cpu and x.shape[0] <= native_max_rows(weight) and native_available()


def _native_linear(out: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight) -> None:
    """The kernel: out = x' @ W'.T, rounding the activations itself (offsets included)."""
    if weight.method == "int8":
        torch.ops.vllm_quant.linear_int8(out, x, weight.qweight, weight.scales, weight.group, weight.superblocks)
    else:
        torch.ops.vllm_quant.linear_int4(out, x, weight.qweight, weight.scales, weight.group, weight.offsets,
                                         weight.superblocks)


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x: [M, K] in the model dtype -> [M, N] in the model dtype."""
    # Each conversion only when it changes something: this runs on every decode linear.
    if bias is None and x.dtype in KERNEL_IO_DTYPES and _runs_native(x, weight):
        # The kernel reads a bf16 x and writes a bf16 out itself (the values and roundings the
        # conversions below would give), sparing a bf16 model two conversion ops a call.
        out = torch.empty(x.shape[0], weight.out_features, dtype=x.dtype)
        _native_linear(out, x if x.is_contiguous() else x.contiguous(), weight)
        return out
    xf = x if x.dtype == torch.float32 else x.float()
    if not xf.is_contiguous():
        xf = xf.contiguous()
    if _runs_native(xf, weight):
        out = torch.empty(xf.shape[0], weight.out_features, dtype=torch.float32)
        _native_linear(out, xf, weight)
    else:
        xr = _rounded(xf)  # [M, K] fp32: the same activations the kernel multiplies
        out = torch.cat([fp32_linear(xr, weight.dequantize(slice(start, start + TILE_ROWS)), None)
                         for start in range(0, weight.out_features, TILE_ROWS)], dim=1)
    if bias is not None:
        out += bias.float()
    return out if x.dtype == torch.float32 else out.to(x.dtype)
