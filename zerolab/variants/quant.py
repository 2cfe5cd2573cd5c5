"""ZeRO++'s quantized collectives (qwZ, qgZ): ZeRO-3's collectives, carrying fewer bytes.

Idea (Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training", arXiv:2306.10209): ZeRO-3 moves 3(n-1)/n·2Ψ bytes a step, two all_gathers of the bf16
weights and one reduce_scatter of the bf16 gradients. ZeRO++ keeps *when* they run and shrinks
*what* they carry:

- qwZ: before a block's all_gather every rank quantizes its bf16 weight shard block-wise to int8
  and the ranks gather the codes and the scales; every rank dequantizes all n shards (its own
  too, so all ranks compute with the same weights) into the bf16 `param_flat`. The fp32 master
  weights and the optimizer never see the error: it is paid once per gather, in the forward
  and backward that use the gathered weights. Bytes: about half of bf16.
- qgZ: the gradient reduce_scatter becomes an all_to_all of quantized chunks: rank r cuts its
  full gradient bucket into the n chunks the ranks own, quantizes each (int4 by default in
  ZeRO++, two codes a byte; or int8), sends chunk j to rank j, and sums the n chunks it receives
  in fp32 after dequantizing them - a reduce_scatter whose wire carries low-bit codes, and whose
  sum is exact arithmetic on the quantized values (a ring reduce_scatter would have to
  requantize at every hop). Bytes: about a quarter of bf16 for int4. On one tier it is the
  single all_to_all (`reduce_scatter`). On nodes, ZeRO++ runs it in two hops
  (`reduce_scatter_two_hop`, the paper's section 3.3, Figures 5-6): an all_to_all inside the
  node, a dequantize and sum of the node's k contributions, a requantize, then an all_to_all
  across nodes. Done in one hop, each rank would send its own unreduced chunks across, k
  times the bytes. hpZ (zerolab.variants.hybrid.HpZ) switches its Comm to the two hops (`by_node`).

Block-wise symmetric quantization, b bits (int8: b = 8, q = 127; int4: b = 4, q = 7): the values
are cut into blocks of B consecutive elements (the last one may be short); each block keeps one
fp32 scale s = max|x| / q and the codes c = round(x / s) in [-q, q]; x is read back as c·s, off
by at most s/2 per element (round to nearest). An all-zero block has s = 0 and codes 0. B =
DEFAULT_BLOCK (256) elements; DeepSpeed's kernels aim at ~4k-element groups for the weights
(`CUDAQuantizer.target_group_size = 8000`, "the optimal size is 4k") and use one group per row
for qgZ: smaller blocks cost more scale bytes and give a smaller error (`zerolab.course.quantcheck`
measures both). Bytes of k quantized values (`theory.quantized_bytes`): ceil(k·b/8) codes +
4·ceil(k/B) scales, i.e. k + 4k/B for int8 (vs 2k in bf16: 0.508x at B = 256) and k/2 + 4k/B for
int4 (0.258x).

The ledger: each quantized collective is one record in the strategy's Comm, of the uint8
payload (codes then scales, one payload per rank), so the ledger's bytes are the bytes on the
wire. The weight gather is a plain `Comm.all_gather` of the payloads: (n-1)·P bytes per rank for
a payload of P bytes. The gradient exchange is recorded as a reduce_scatter (its role) of the n
payloads of Q bytes: (n-1)/n·nQ = (n-1)·Q per rank, exactly what the all_to_all under it sends.
`theory.quantized_traffic_bytes` gives the per-step totals, unit by unit.

    from zerolab import ZeRO3
    s = ZeRO3(model, comm, quantize=Quantize(weights="int8", grads="int4"))
    python -m zerolab train --stage 3 --preset tiny --quantize-weights int8 --quantize-grads int4

Only the forward / backward gathers are quantized: `strategy.gathered()` (phase "eval": reading,
saving or editing the weights) gathers them exactly. The payloads and the fp32 decode buffers
are transient and not in the memory meter's categories.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import theory

DEFAULT_BLOCK = 256                     # elements per scale
SCALE_DTYPE = torch.float32             # theory.SCALE_BYTES = 4 bytes per block
WEIGHT_FORMATS = ("int8",)              # qwZ
GRAD_FORMATS = ("int8", "int4")         # qgZ (ZeRO++: int4)


@dataclass(frozen=True)
class Quantize:
    """What ZeRO-3's collectives carry: weights None (bf16) or "int8"; grads None, "int8" or
    "int4"; block: elements per scale. ValueError (one line) for anything else."""
    weights: str | None = None
    grads: str | None = None
    block: int = DEFAULT_BLOCK

    def __post_init__(self):
        for name, value, formats in (("weights", self.weights, WEIGHT_FORMATS),
                                     ("grads", self.grads, GRAD_FORMATS)):
            if value is not None and value not in formats:
                raise ValueError(f"quantize {name} {value!r} is not one of "
                                 f"{', '.join(map(repr, (None, *formats)))}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"quantize block {self.block!r} must be an integer >= 1 (elements "
                             "per scale)")

    @classmethod
    def of(cls, spec) -> "Quantize | None":
        """None for None / False / an empty spec; a Quantize from a Quantize or a dict."""
        if not spec:
            return None
        if isinstance(spec, cls):
            return spec if (spec.weights or spec.grads) else None
        if isinstance(spec, dict):
            return cls.of(cls(**{k: (v or None) if k != "block" else v for k, v in spec.items()}))
        raise ValueError(f"quantize {spec!r} must be a zerolab.variants.quant.Quantize or a dict "
                         "(weights=, grads=, block=)")


def bits_of(fmt: str) -> int:
    """8 for "int8", 4 for "int4"."""
    return theory.QUANT_BITS[fmt]


# --- block-wise symmetric quantization ------------------------------------------------------------
def quantize(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., k] (any float dtype) -> codes int8 [..., k] in [-q, q] (q = 2^(bits-1) - 1) and
    scales fp32 [..., ceil(k/block)]: each row of x is cut into blocks of `block` elements."""
    q = 2 ** (bits - 1) - 1
    k = x.shape[-1]
    nb = math.ceil(k / block)
    xf = torch.nn.functional.pad(x.float(), (0, nb * block - k))       # [..., nb·B] fp32
    blocks = xf.unflatten(-1, (nb, block))                             # [..., nb, B]
    scales = blocks.abs().amax(-1) / q                                 # [..., nb]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(blocks / safe.unsqueeze(-1)).clamp_(-q, q)     # all-zero block: codes 0
    return codes.flatten(-2)[..., :k].to(torch.int8), scales.to(SCALE_DTYPE)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """codes int8 [..., k], scales [..., ceil(k/block)] -> fp32 [..., k]: code x its block's scale."""
    k, nb = codes.shape[-1], scales.shape[-1]
    padded = torch.nn.functional.pad(codes.float(), (0, nb * block - k)).unflatten(-1, (nb, block))
    return (padded * scales.float().unsqueeze(-1)).flatten(-2)[..., :k]


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-7, 7] [..., k] -> uint8 [..., ceil(k/2)]: two codes a byte, as code + 8
    (element 2i in the low nibble, 2i+1 in the high one; an odd k gets a zero code)."""
    u = (codes.to(torch.int16) + 8).to(torch.uint8)
    u = torch.nn.functional.pad(u, (0, codes.shape[-1] % 2), value=8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of pack_int4: uint8 [..., ceil(k/2)] -> int8 codes [..., k]."""
    both = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)[..., :k]
    return (both.to(torch.int16) - 8).to(torch.int8)


def payload_bytes(k: int, bits: int, block: int) -> int:
    """Bytes of one payload of k quantized values (`theory.quantized_bytes`)."""
    return theory.quantized_bytes(k, bits, block)


def encode(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """x [..., k] -> uint8 payloads [..., P]: the codes (int8 as bytes, int4 packed two a byte),
    then the fp32 scales as bytes; P = payload_bytes(k, bits, block)."""
    codes, scales = quantize(x, bits, block)
    body = pack_int4(codes) if bits == 4 else codes.view(torch.uint8)
    return torch.cat([body, scales.contiguous().view(torch.uint8)], dim=-1)


def decode(payload: torch.Tensor, k: int, bits: int, block: int) -> torch.Tensor:
    """uint8 payloads [..., P] -> fp32 [..., k], the values `encode` quantized."""
    n_code = math.ceil(k * bits / 8)
    body, tail = payload[..., :n_code], payload[..., n_code:].clone()    # 4-byte aligned
    codes = unpack_int4(body, k) if bits == 4 else body.contiguous().view(torch.int8)
    return dequantize(codes, tail.view(SCALE_DTYPE), block)


# --- the collectives ---------------------------------------------------------------------------
def all_gather(comm, output: torch.Tensor, input: torch.Tensor, *, bits: int = 8,
               block: int = DEFAULT_BLOCK, what: str = "params", unit: str = "",
               async_op: bool = False):
    """qwZ: every rank's `input` [k] quantized, gathered as one uint8 payload per rank through
    `comm.all_gather` (the ledger records the payloads' bytes), and dequantized into `output`
    [n·k] (any float dtype) in rank order when the returned Handle is waited for."""
    n, k = comm.world_size, input.numel()
    if output.numel() != n * k:
        raise ValueError(f"all_gather: output has {output.numel()} elements, expected "
                         f"{n} x {k} (chunk size x world_size)")
    send = encode(input.reshape(-1), bits, block)                      # [P] uint8
    recv = send.new_empty(n * send.numel())                            # [n·P] uint8
    handle = comm.all_gather(recv, send, what=what, unit=unit, async_op=True)

    def dequantized():
        output.view(-1).copy_(decode(recv.view(n, -1), k, bits, block).reshape(-1))
    handle.post = dequantized           # runs inside wait(), before its owner's on_done
    if not async_op:
        handle.wait()
    return handle


def reduce_scatter(comm, output: torch.Tensor, input: torch.Tensor, *, bits: int = 4,
                   block: int = DEFAULT_BLOCK, what: str = "grads", unit: str = "",
                   async_op: bool = False):
    """qgZ: `input` [n·k] cut into the n chunks the ranks own, each quantized; one all_to_all
    sends chunk j's payload to rank j; rank r dequantizes the n payloads of its chunk and sums
    them in fp32 into `output` [k] (when the Handle is waited for). Recorded in the ledger as a
    reduce_scatter of the n payloads: (n-1)/n of them leave the rank, as in the all_to_all."""
    n, k = comm.world_size, output.numel()
    if input.numel() != n * k:
        raise ValueError(f"reduce_scatter: full tensor has {input.numel()} elements, expected "
                         f"{n} x {k} (chunk size x world_size)")
    send = encode(input.reshape(n, k), bits, block).reshape(-1)        # [n·Q] uint8
    recv = torch.empty_like(send)

    def summed():
        output.view(-1).copy_(decode(recv.view(n, -1), k, bits, block).sum(0))
    # Comm has no all_to_all of its own: its _issue records the exchange (op "reduce_scatter")
    # and times it like any other collective
    return comm._issue("reduce_scatter", send, what, unit, async_op,
                       lambda: dist.all_to_all_single(recv, send, group=comm.group,
                                                      async_op=True), post=summed)


def reduce_scatter_two_hop(intra, inter, output: torch.Tensor, input: torch.Tensor, *,
                           bits: int = 4, block: int = DEFAULT_BLOCK, what: str = "grads",
                           unit: str = "", async_op: bool = False):
    """qgZ as ZeRO++ builds it (arXiv:2306.10209, section 3.3, Figures 5-6): a reduce_scatter of
    `input` [N·c] over the world in two quantized all_to_alls, one on each tier. `intra`, `inter`:
    this rank's node Comms (`tiers.node_comms`: k ranks of its node; m = N/k ranks with its
    local index, one per node). Rank r = a·k + l (node a, local index l) ends with chunk r of
    the sum in `output` [c], where ZeRO-3's reduce_scatter puts it.

        reorder    [m, k, c] -> [k, m, c]: row l' holds the chunks b·k + l' of every node b,
                   the ones local rank l' gathers (the paper's tensor slice reordering)
        hop 1      quantize each chunk; all_to_all inside the node (row l' to local rank l')
        reduce     dequantize, sum the node's k rows in fp32: node a's sum of chunks b·k + l
        hop 2      requantize each of the m chunks; all_to_all across nodes (chunk b·k + l to
                   node b's rank l); dequantize and sum the m node sums of chunk a·k + l = r

    Each hop is one ledger record of its Comm (tier "intra" / "inter"), recorded as a
    reduce_scatter of its payloads like the one-hop `reduce_scatter`: hop 1 (k-1)·m·Q bytes a
    rank, hop 2 (m-1)·Q, Q = quantized_bytes(c). Error: two quantizations, each at most half a
    block's scale per value: |result - exact sum| <= sum over the N ranks of s1/2 plus sum over
    the m nodes of s2/2 (s1: the block's scale in a rank's chunk, s2: in a node's sum), against
    the one hop's first term alone (measured on 2 nodes of 2: rms error 1.4-1.5x the one hop's,
    tests/test_zeropp.py). Hop 2 is issued when hop 1 is waited for (the returned
    Handle, hop 1's: its post runs hop 2 to completion). ValueError unless input has N·c
    elements."""
    k, m, c = intra.world_size, inter.world_size, output.numel()
    if input.numel() != k * m * c:
        raise ValueError(f"reduce_scatter: full tensor has {input.numel()} elements, expected "
                         f"{k * m} x {c} (chunk size x world_size)")
    swizzled = input.reshape(m, k, c).transpose(0, 1)                  # [k, m, c]: row l' to l'
    send = encode(swizzled, bits, block).reshape(-1)                   # [k·m·Q] uint8
    recv = torch.empty_like(send)

    def second_hop():
        node_sum = decode(recv.view(k, m, -1), c, bits, block).sum(0)  # [m, c] fp32
        send2 = encode(node_sum, bits, block).reshape(-1)              # [m·Q] uint8, requantized
        recv2 = torch.empty_like(send2)
        inter._issue("reduce_scatter", send2, what, unit, False,
                     lambda: dist.all_to_all_single(recv2, send2, group=inter.group,
                                                    async_op=True))
        output.view(-1).copy_(decode(recv2.view(m, -1), c, bits, block).sum(0))
    return intra._issue("reduce_scatter", send, what, unit, async_op,
                        lambda: dist.all_to_all_single(recv, send, group=intra.group,
                                                       async_op=True), post=second_hop)


class QuantizedComm:
    """A Comm for ZeRO-3 whose weight all_gathers in forward / backward (what "params") and
    gradient reduce_scatters (what "grads") are quantized as `spec` says; every other call and
    attribute is the wrapped Comm's (its ledger, phase, step). ZeRO3(quantize=...) uses one.
    After `by_node(intra, inter)` (hpZ calls it) the gradients go in ZeRO++'s two hops."""

    def __init__(self, comm, spec: Quantize):
        object.__setattr__(self, "inner", comm)
        object.__setattr__(self, "spec", spec)
        object.__setattr__(self, "nodes", None)

    def by_node(self, intra, inter):
        """Run qgZ in two hops over these node Comms (`tiers.node_comms`), one all_to_all a tier
        (`reduce_scatter_two_hop`), from now on."""
        object.__setattr__(self, "nodes", (intra, inter))

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):     # e.g. current_phase: the wrapped Comm's
        setattr(self.inner, name, value)

    def all_gather(self, output, input, *, what, unit="", async_op=False):
        if (self.spec.weights and what == "params"
                and self.inner.current_phase in ("forward", "backward")):
            return all_gather(self.inner, output, input, bits=bits_of(self.spec.weights),
                              block=self.spec.block, what=what, unit=unit, async_op=async_op)
        return self.inner.all_gather(output, input, what=what, unit=unit, async_op=async_op)

    def reduce_scatter(self, output, input, *, what, unit="", async_op=False):
        if self.spec.grads and what == "grads" and self.nodes is not None:
            return reduce_scatter_two_hop(*self.nodes, output, input,
                                          bits=bits_of(self.spec.grads), block=self.spec.block,
                                          what=what, unit=unit, async_op=async_op)
        if self.spec.grads and what == "grads":
            return reduce_scatter(self.inner, output, input, bits=bits_of(self.spec.grads),
                                  block=self.spec.block, what=what, unit=unit, async_op=async_op)
        return self.inner.reduce_scatter(output, input, what=what, unit=unit, async_op=async_op)


def quantized_comm(comm, spec=None):
    """`comm` itself when `spec` quantizes nothing (None, False, {}), else a QuantizedComm
    (spec: a Quantize or a dict of its fields)."""
    spec = Quantize.of(spec)
    return comm if spec is None else QuantizedComm(comm, spec)
