"""The cost model against numbers derived by hand (in the comments) from the α-β ring formulas.

Sources: nccl-tests PERFORMANCE.md (ring bytes 2(n-1)/n and (n-1)/n), scaling-book (α-β model),
NVIDIA/nccl#457 (a tree all_reduce sends 2S per rank), PaLM appendix B (6Ψ + 12·L·d·s FLOPs per
token, checked here against torch's FlopCounterMode), NVIDIA datasheets for the profiles.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from zerolab.timing import costmodel as cm
from zerolab.timing import hardware as hw
from zerolab.timing.hardware import Link
from zerolab.timing.costmodel import Unit


def test_collective_times_by_hand():
    link = Link("t", bandwidth=1e9, latency=1e-5)
    # all_reduce, n = 4, S = 1 MB: 2·3 steps · 10 us + 2·3/4 · 1e6 / 1e9 s = 60 us + 1.5 ms
    assert cm.collective_time("all_reduce", 1e6, 4, link) == pytest.approx(1.56e-3, rel=1e-12)
    # reduce_scatter and all_gather: 3 · 10 us + 3/4 · 1 ms
    for op in ("reduce_scatter", "all_gather"):
        assert cm.collective_time(op, 1e6, 4, link) == pytest.approx(0.78e-3, rel=1e-12)
    # broadcast: 3 · 10 us + 1 ms
    assert cm.collective_time("broadcast", 1e6, 4, link) == pytest.approx(1.03e-3, rel=1e-12)
    assert cm.collective_time("all_reduce", 1e6, 1, link) == 0.0
    with pytest.raises(ValueError, match="'gather'"):
        cm.collective_time("gather", 1, 2, link)


def test_ring_latency_grows_with_n_and_bandwidth_term_saturates():
    link = Link("t", bandwidth=1e9, latency=1e-5)
    small = [cm.collective_time("all_reduce", 8, n, link) for n in (2, 8, 64)]
    assert small == pytest.approx([2 * (n - 1) * 1e-5 + 2 * (n - 1) / n * 8e-9 for n in (2, 8, 64)])
    big = Link("t", bandwidth=1e9, latency=0.0)
    assert cm.collective_time("all_reduce", 1e9, 1024, big) == pytest.approx(2 * 1023 / 1024)


def test_compute_time_six_psi_per_token():
    dev = hw.Device("d", 1e15)
    # 1e9 params x 1000 tokens x 6 FLOPs / 1e15 FLOP/s = 6 ms at peak; forward a third, backward two
    assert cm.compute_time(1e9, 1000, dev, mfu=1.0) == pytest.approx(6e-3)
    assert cm.compute_time(1e9, 1000, dev, passes="fwd", mfu=1.0) == pytest.approx(2e-3)
    assert cm.compute_time(1e9, 1000, dev, passes="bwd", mfu=1.0) == pytest.approx(4e-3)
    # the default is a realistic MFU, 0.4 (Llama 3: 38-43 % on H100s), not the datasheet peak
    assert cm.MFU == 0.4 and cm.compute_time(1e9, 1000, dev) == pytest.approx(6e-3 / 0.4)
    with pytest.raises(ValueError, match="mfu 0 is not in"):
        cm.compute_time(1, 1, dev, mfu=0)


def test_mfu_scales_compute_by_exactly_one_over_mfu():
    dev, link = hw.DEVICES["h100"], hw.LINKS["ib-ndr"]
    peak = cm.compute_time(7.5e9, 4096, dev, mfu=1.0, n_layer=32, d_model=4096, seq_len=2048)
    t_peak = cm.zero3_comm_bound_tokens(2e8, 64, link, dev, mfu=1.0, d_model=4096, seq_len=2048)
    for m in (0.3, 0.4, 0.5, 1.0):
        t = cm.compute_time(7.5e9, 4096, dev, mfu=m, n_layer=32, d_model=4096, seq_len=2048)
        assert t * m == pytest.approx(peak, rel=1e-12)
        # slower compute hides the same gather with fewer tokens: T* scales with MFU
        assert cm.zero3_comm_bound_tokens(2e8, 64, link, dev, mfu=m, d_model=4096,
                                          seq_len=2048) == pytest.approx(m * t_peak, rel=1e-12)
        units = cm.uniform_units(1e9, 4, 1000, dev, m)
        assert [u.fwd_s * m for u in units] == pytest.approx([2 * 2.5e8 * 1000 / 989e12] * 4)


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, float("nan"), True, "0.4"])
def test_bad_mfu_is_refused_naming_the_range(bad):
    with pytest.raises(ValueError, match=r"is not in \(0, 1\]"):
        cm.check_mfu(bad)


def test_attention_flops_match_torchs_flop_counter():
    """6Ψ + 12·L·d·s per token against torch's FlopCounterMode on the course's GPT (math SDPA, so
    that QKᵀ and AV are counted matmuls): the Linear weights' matmuls are 6 FLOPs per weight per
    token (forward, grad of input, grad of weight), the rest is attention: 12·L·d·s exactly."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from zerolab.model import GPT, get_config
    cfg = get_config("tiny")                       # L = 4, d = 64, T = 64
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x, x).backward()
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    per_token = counter.get_total_flops() / x.numel()
    ours = cm.flops_per_token(weights, n_layer=cfg.n_layer, d_model=cfg.n_embd,
                              seq_len=cfg.block_size)
    assert ours == per_token
    assert ours - 6 * weights == 12 * 4 * 64 * 64
    # forward alone is a third: 2Ψ + 4·L·d·s
    assert cm.flops_per_token(weights, n_layer=4, d_model=64, seq_len=64, passes="fwd") == (
        2 * weights + 4 * 4 * 64 * 64)


def test_tree_all_reduce_latency_grows_with_log2_n():
    lat = Link("lat", bandwidth=1e30, latency=1.0)          # latency only: times count α's
    for k in range(1, 11):
        n = 2 ** k
        assert cm.collective_time("all_reduce", 8, n, lat, "tree") == pytest.approx(2 * k)
        assert cm.collective_time("all_reduce", 8, n, lat) == pytest.approx(2 * (n - 1))
        assert cm.collective_time("all_reduce", 8, n, lat, "auto") == pytest.approx(min(2 * k, 2 * (n - 1)))
    # not a power of two: the tree's depth rounds up, ⌈log2 1000⌉ = 10
    assert cm.collective_time("all_reduce", 8, 1000, lat, "tree") == pytest.approx(20)
    # NCCL has no tree reduce_scatter / all_gather: they stay rings under every algorithm
    for op in ("reduce_scatter", "all_gather"):
        assert cm.collective_time(op, 8, 1024, lat, "tree") == pytest.approx(1023)
    # bandwidth only: a tree all_reduce sends 2S per rank, the ring 2(n-1)/n · S
    bw = Link("bw", bandwidth=1.0, latency=0.0)
    assert cm.collective_time("all_reduce", 10, 4, bw, "tree") == pytest.approx(20)
    assert cm.collective_time("all_reduce", 10, 4, bw, "auto") == pytest.approx(15)
    assert cm.collective_time("all_reduce", 10, 1, bw, "tree") == 0.0
    with pytest.raises(ValueError, match="'nvls'"):
        cm.collective_time("all_reduce", 8, 4, lat, "nvls")


def test_ring_and_tree_at_1024_ranks_on_ib_ndr():
    link = hw.LINKS["ib-ndr"]                                  # α = 5 us
    ring = cm.collective_time("all_reduce", 8, 1024, link)
    tree = cm.collective_time("all_reduce", 8, 1024, link, "tree")
    # (8 bytes add well under a microsecond)
    assert ring == pytest.approx(2046 * 5e-6, rel=1e-5) and tree == pytest.approx(20 * 5e-6, rel=1e-5)
    note = cm.latency_note(1024, link)
    assert "2(n-1)·α = 10.2 ms" in note and "2·⌈log2 n⌉·α = 0.1 ms" in note and "--algo auto" in note


def test_step_time_auto_models_only_the_all_reduces_as_trees():
    lat = Link("lat", bandwidth=1e30, latency=1.0)
    units = [Unit("block.0", 1, 0.0, 0.0), Unit("block.1", 1, 0.0, 0.0)]
    # DDP, no compute: two all_reduces back to back; ring 2·15 α each, tree 2·4 α each
    assert cm.step_time(0, units, 16, lat).total == pytest.approx(60)
    assert cm.step_time(0, units, 16, lat, algorithm="auto").total == pytest.approx(16)
    # ZeRO-2: two reduce_scatters and two all_gathers stay rings (15 α each); the norm all_reduce
    # (4 bytes) is the only tree: 4·15 + 8 = 68 instead of 4·15 + 30 = 90
    assert cm.step_time(2, units, 16, lat).total == pytest.approx(90)
    assert cm.step_time(2, units, 16, lat, algorithm="auto").total == pytest.approx(68)


# Two blocks, forward 1 s and backward 2 s each; n = 2 and α = 0, so with bf16 (2 bytes per
# element) and β = 2 bytes/s a unit of 1 element takes all_reduce 1 s, reduce_scatter and
# all_gather 0.5 s each.
UNITS = [Unit("block.0", 1, 1.0, 2.0), Unit("block.1", 1, 1.0, 2.0)]
SLOW = Link("slow", bandwidth=2.0, latency=0.0)


def test_ddp_overlap_by_hand():
    # forward 0-2; block.1 backward 2-4, its all_reduce 4-5; block.0 backward 4-6, all_reduce 6-7
    over = cm.step_time(0, UNITS, 2, SLOW)
    assert over.total == pytest.approx(7.0) and over.compute == pytest.approx(6.0)
    assert [(c.start, c.end) for c in over.collectives] == [(4, 5), (6, 7)]
    # without overlap every all_reduce is waited at once: 6 s compute + 2 s comm
    assert cm.step_time(0, UNITS, 2, SLOW, overlap=False).total == pytest.approx(8.0)


def test_zero3_with_and_without_prefetch_by_hand():
    # no prefetch: gather 0-.5, fwd .5-1.5, gather 1.5-2, fwd 2-3; bwd: gather 3-3.5, bwd 3.5-5.5,
    # reduce_scatter 5.5-6 and gather of block.0 queued behind it 6-6.5, bwd 6.5-8.5, rs 8.5-9
    plain = cm.step_time(3, UNITS, 2, SLOW, clip=False)
    assert plain.total == pytest.approx(9.0)
    assert cm.step_time(3, UNITS, 2, SLOW, overlap=False, clip=False).total == pytest.approx(9.0)
    # prefetch: gather 0-.5, block.1's gather .5-1 under fwd .5-1.5, fwd 1.5-2.5; bwd: gather
    # 2.5-3, block.0's gather 3-3.5 under bwd 3-5, rs 5-5.5 under bwd 5-7, rs 7-7.5
    pre = cm.step_time(3, UNITS, 2, SLOW, prefetch=True, clip=False)
    assert pre.total == pytest.approx(7.5)
    assert pre.by_op() == pytest.approx({"all_reduce": 0, "reduce_scatter": 1.0,
                                         "all_gather": 2.0, "broadcast": 0})


def test_zero2_all_gather_after_step_is_exposed():
    # rs of block.1 4-4.5, of block.0 6-6.5; grad-norm scalar (4 bytes: 2 s at 2 B/s, factor 1)
    # 6.5-8.5; all_gathers 8.5-9.5
    t = cm.step_time(2, UNITS, 2, SLOW)
    assert t.total == pytest.approx(9.5)
    assert cm.step_time(2, UNITS, 2, SLOW, clip=False).total == pytest.approx(7.5)


def test_stage_ordering_from_bytes():
    """With compute long enough to hide gradient traffic, exposed comm is ZeRO-3 > ZeRO-2 > DDP."""
    units = cm.uniform_units(1e9, 16, 4096, hw.DEVICES["h100"])
    link = hw.LINKS["100gbe"]
    exposed = [cm.step_time(s, units, 64, link).exposed_comm for s in (0, 2, 3)]
    assert exposed[0] < exposed[1] < exposed[2]
    pre = cm.step_time(3, units, 64, link, prefetch=True)
    assert pre.total < cm.step_time(3, units, 64, link).total


def test_comm_bound_threshold_is_where_gather_equals_compute():
    dev, n, psi_b = hw.DEVICES["h100"], 64, 2e8
    link = hw.LINKS["ib-ndr"]
    t_star = cm.zero3_comm_bound_tokens(psi_b, n, link, dev)
    gather = cm.collective_time("all_gather", 2 * psi_b, n, link)
    assert cm.compute_time(psi_b, t_star, dev, passes="fwd") == pytest.approx(gather)
    # closed form with α = 0: (n-1)/n · F·MFU/β = 63/64 · 989e12 / 50e9 = 19,471.9 tokens at peak
    no_alpha = Link("x", link.bandwidth, 0.0)
    assert cm.zero3_comm_bound_tokens(psi_b, n, no_alpha, dev, mfu=1.0) == pytest.approx(
        63 / 64 * 989e12 / 50e9)
    assert cm.zero3_comm_bound_tokens(psi_b, n, no_alpha, dev) == pytest.approx(
        0.4 * 63 / 64 * 989e12 / 50e9)
    # attention adds 4·d·s forward FLOPs per token to the block's 2Ψ_u: T* falls by that ratio
    with_attn = cm.zero3_comm_bound_tokens(psi_b, n, no_alpha, dev, d_model=4096, seq_len=2048)
    assert with_attn == pytest.approx(0.4 * 63 / 64 * 989e12 / 50e9 * 2 * psi_b
                                      / (2 * psi_b + 4 * 4096 * 2048))
    at_t = cm.zero3_comm_bound_tokens(psi_b, n, link, dev, d_model=4096, seq_len=2048)
    assert cm.compute_time(psi_b, at_t, dev, passes="fwd", n_layer=1, d_model=4096,
                           seq_len=2048) == pytest.approx(gather)


def test_profiles_have_sources_and_custom_values():
    assert all(len(p.source) > 20 for p in (*hw.LINKS.values(), *hw.DEVICES.values()))
    assert hw.get_link(gbps=8).bandwidth == pytest.approx(1e9)            # 8 Gb/s = 1 GB/s
    assert hw.get_link("ib-ndr").gbps == pytest.approx(400)
    assert hw.get_link("ib-ndr", latency_us=1).latency == pytest.approx(1e-6)
    assert hw.get_device(tflops=100).flops == 1e14
    for bad in (dict(name="wifi"), dict(gbps=0), dict(gbps=1, latency_us=-1), dict()):
        with pytest.raises(ValueError):
            hw.get_link(**bad)


def test_cli_time_prints_stages_and_threshold():
    argv = [sys.executable, "-m", "zerolab", "time", "--params", "7.5e9", "--world-size", "64",
            "--tokens-per-rank", "4096", "--link", "ib-ndr", "--device", "h100"]
    out = subprocess.run(argv + ["--mfu", "1", "--seq-len", "0"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    # at peak, 6Ψ only: 63/64 · 989e12/50e9 = 19,472 plus 63 · 5 us · 989e12 / (2 · 7.5e9/32)
    # = 665: 20,136
    assert "ZeRO-3 +prefetch" in out.stdout and "T* = 20,136 tokens" in out.stdout
    # the defaults: MFU 0.4 and attention at s = 2048, d = 4416 (Ψ ≈ 12·L·d², L = 32): the
    # gather (20,136 · 2Ψ_u / F at peak) over (2Ψ_u + 4·d·s) FLOPs per token at 0.4 F
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    block = 7.5e9 / 32
    t_star = 20_136.4 * 2 * block * 0.4 / (2 * block + 4 * 4416 * 2048)
    assert f"T* = {t_star:,.0f} tokens" in out.stdout, out.stdout
    assert "MFU 0.4" in out.stdout and "Llama 3" in out.stdout
    share = 12 * 32 * 4416 * 2048 / (6 * 7.5e9 + 12 * 32 * 4416 * 2048)
    assert f"attention's 12·L·d·s is {share:.1%}" in out.stdout
    assert "collectives: ring" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "zerolab", "time", "--link", "wifi"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "'wifi'" in bad.stderr and len(bad.stderr.splitlines()) == 1


THREE = [Unit(f"block.{i}", 1, 1.0, 2.0) for i in range(3)]


def test_zero3_unlimited_prefetch_by_hand():
    # forward: gather block.0 0-.5, then block.1 and block.2 issued at .5 run .5-1 and 1-1.5
    # under block.0's compute .5-1.5; fwd ends 3.5. backward: gather block.2 3.5-4, block.1 and
    # block.0 queued 4-4.5, 4.5-5 under bwd 4-6; rs 6-6.5; bwd 6-8, rs 8-8.5; bwd 8-10; the third
    # rs waits for the first (two in flight), runs 10-10.5
    t = cm.step_time(3, THREE, 2, SLOW, prefetch=-1, clip=False)
    assert t.total == pytest.approx(10.5)
    fwd = [(c.unit, c.issued, c.start, c.end) for c in t.collectives if c.phase == "forward"]
    assert fwd == [("block.0", 0, 0, .5), ("block.1", .5, .5, 1), ("block.2", .5, 1, 1.5)]
    assert cm.step_time(3, THREE, 2, SLOW, prefetch=0, clip=False).total == pytest.approx(
        cm.step_time(3, THREE, 2, SLOW, prefetch=False, clip=False).total)
    with pytest.raises(ValueError, match="-2"):
        cm.step_time(3, THREE, 2, SLOW, prefetch=-2)


def test_keep_root_saves_the_second_root_gather():
    units = [Unit("root", 4, 0.5, 0.5), *UNITS]      # root all_gather: 4 x 2 B / 2 / 2 B/s = 2 s
    plain = cm.step_time(3, units, 2, SLOW, clip=False)
    kept = cm.step_time(3, units, 2, SLOW, clip=False, keep_root=True)
    assert plain.total - kept.total == pytest.approx(2.0)
    assert sum(c.unit == "root" and c.op == "all_gather" for c in kept.collectives) == 1


def test_merged_buckets_issue_fewer_collectives():
    merged = cm.merge_units([Unit("root", 1), *THREE], bucket_numel=2)
    assert [(u.name, u.numel, u.bwd_s) for u in merged] == [
        ("root", 1, 0.0), ("block.0-1", 2, 4.0), ("block.2", 1, 2.0)]
    # latency-bound link (α = 1 s, β huge): 2 s per all_reduce at n = 2, whatever the size;
    # per block: fwd 0-3; bwd block.2 3-5, block.1 5-7, block.0 7-9; ARs 5-7, 7-9, 9-11
    lat = Link("lat", bandwidth=1e12, latency=1.0)
    assert cm.step_time(0, THREE, 2, lat).total == pytest.approx(11.0)
    # merged: block.2 bwd 3-5, AR 5-7; block.1+0 bwd 5-9, AR 9-11: same end, one α pair fewer
    two = cm.merge_units(THREE, bucket_numel=2)
    assert len(cm.step_time(0, two, 2, lat).collectives) == 2
    with pytest.raises(ValueError):
        cm.merge_units(THREE, 0)


def test_custom_link_values_are_named_as_custom():
    """A named link with a replaced bandwidth must not be printed as the named link with its
    datasheet source (a new user read "link ib-ndr ... 100 Gb/s" with the NDR source)."""
    half = hw.get_link("ib-ndr", gbps=100)
    assert half.name == "ib-ndr with a custom bandwidth" and half.source.startswith("custom bandwidth")
    assert half.latency == hw.LINKS["ib-ndr"].latency and half.bandwidth == 100e9 / 8
    both = hw.get_link("ib-ndr", gbps=100, latency_us=10)
    assert (both.name, both.source) == ("custom", "custom")
    assert hw.get_link("ib-ndr") is hw.LINKS["ib-ndr"]


def exit_code(argv):
    """cli.main's exit code: its own return, or argparse's SystemExit for a bad value."""
    from zerolab import cli
    try:
        return cli.main(argv)
    except SystemExit as stop:
        return stop.code


@pytest.mark.parametrize("argv, says", [(["--blocks", "1000000"], "'1000000' is outside the accepted range: a whole number in 1 .. 10000"),
                                        (["--params", "100", "--blocks", "1000"], "between 1 and 100")])
def test_zerolab_time_refuses_more_blocks_than_it_can_replay(argv, says, capsys):
    """--blocks 1e6 ran for minutes and 2.6 GB; 1e11 was killed for memory with no message."""
    assert exit_code(["time", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


@pytest.mark.parametrize("command", ["time", "whatif"])
@pytest.mark.parametrize("bad", ["0", "1.5", "-1", "nan"])
def test_zerolab_refuses_a_bad_mfu_in_one_line(command, bad, capsys):
    """--mfu outside (0, 1] is refused before anything runs (whatif: before the fake world)."""
    assert exit_code([command, "--mfu", bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--mfu" in err[0] and repr(bad) in err[0] and "> 0 and <= 1" in err[0], err


def test_zero12_gather_before_forward_moves_the_gathers_under_the_forward():
    """The same all_gathers (count and bytes); before_forward hides at most the forward's compute
    (they can only overlap it), after_step hides none of them; with no compute nothing changes."""
    from zerolab.timing import costmodel as cm, hardware
    units = [cm.Unit("root", 1e6, 0.002, 0.004)] + [cm.Unit(f"block.{i}", 1e6, 0.01, 0.02)
                                                     for i in range(4)]
    link = hardware.get_link(gbps=0.1, latency_us=100)
    fwd = sum(u.fwd_s for u in units)
    for stage in (1, 2):
        after = cm.step_time(stage, units, 2, link, zero12_gather="after_step")
        before = cm.step_time(stage, units, 2, link, zero12_gather="before_forward")
        gathers = [[c.size_bytes for c in s.collectives if c.op == "all_gather"]
                   for s in (after, before)]
        assert sorted(gathers[0]) == sorted(gathers[1]) and len(gathers[0]) == len(units)
        assert 0 < after.total - before.total <= fwd + 1e-12
        idle = [cm.Unit(u.name, u.numel) for u in units]
        assert cm.step_time(stage, idle, 2, link, zero12_gather="before_forward").total == \
            pytest.approx(cm.step_time(stage, idle, 2, link).total)
    with pytest.raises(ValueError, match="zero12_gather"):
        cm.step_time(1, units, 2, link, zero12_gather="later")
