"""What a stage writes and what rank 0 prints: the rank's JSON result, and the bytes table.

Idea: every rank writes OUT/stage{S}/rank{r}.json: the run's settings, the losses and step
times, the bytes it held after the last step (measured, by state) next to the formula, and the
bytes it moved (the comm ledger, each record) next to the formula - at Ψ and at the padded Ψ
the strategies really hold. `compare_rows` / `format_rows` turn such results into the one table
that `zerolab train` and `zerolab compare` print; `zerolab.course.results.load_run` reads a run
folder back.

    stage    final loss  model states     formula  ratio  bytes/step     formula  ratio
    DDP        4.674506     3,528,704   3,528,704  1.000     661,632     661,632  1.000
"""
from __future__ import annotations

import statistics

import torch.distributed as dist

from .. import theory
from ..variants import tiers
from ..memory import padding_bytes
from ..variants.offload import HOST_STATES, device_bytes, host_bytes
from .knobs import optimizer_ladder


def stage_result(st, ledger: list[dict]) -> dict:
    """The JSON of one stage on one rank (`stage.Stage` after its last phase). Bytes are bytes,
    times seconds; `ledger` is comm.Comm.to_json() (every collective of the stage). The
    strategy's knobs are what it says it was built with (`strategy.options`)."""
    args, comm, stage = st.args, st.comm, st.stage
    built = st.strategy.options
    n, psi, A = comm.world_size, st.psi, args.grad_accum
    psi_padded = sum(u.padded_numel for u in st.strategy.units)
    gd = getattr(args, "grad_dtype", None)
    ladder = optimizer_ladder(args)     # {"states", "rounding"}: the optimizer's state dtypes
    measured_state = {s: st.memory["current"].get(s, 0) for s in theory.STATES}
    q = built["quantize"]                               # ZeRO++'s quantized collectives, or None
    hy = built["hybrid"]                                # (kind, k): HSDP / hpZ, or None
    grad_op = built["grad_op"] or "all_reduce"
    states_n = hy[1] if hy and hy[0] == "hsdp" else n   # HSDP shards over a node's k ranks
    shards = [u.shard_numel for u in st.strategy.units]
    tiers_padded = (tiers.zeropp_traffic_bytes(shards, n, hy[1], q.weights, q.grads, q.block,
                                               True, args.precision, A, gd) if hy and q
                    else tiers.hybrid_traffic_bytes(psi_padded, n, hy[1], hy[0], args.precision,
                                                    A, gd) if hy else None)   # ZeRO++ whole: hpZ + q
    traffic_padded = _by_op(tiers_padded) if hy else (theory.quantized_traffic_bytes(
        shards, n, q.weights, q.grads, q.block, args.precision, A, gd) if q else theory.traffic_bytes(psi_padded, n, stage, args.precision,
                                              grad_op, A, gd))
    return _with_offload(st, {
        "run_id": args.run_id, "stage": stage, "name": built["name"], "rank": comm.rank,
        "world_size": n, "params_sha256": st.params_sha256,
        "backend": dist.get_backend(), "device": str(st.device), "precision": args.precision,
        "preset": args.preset, "model_config": st.cfg.__dict__, "num_params": psi,
        "num_params_padded": psi_padded, "steps": args.steps, "batch_size": args.batch_size,
        "grad_accum": A, "grad_dtype": gd or args.precision,
        "optimizer_states": ladder["states"], "master_rounding": ladder["rounding"],
        "zero1_grad_op": built["grad_op"], "zero12_gather": built["gather"],
        "bucket_mb": built["bucket_mb"], "zero3_prefetch": built["prefetch"],
        "zero3_keep_root": built["keep_root"],
        "quantize": ({"weights": q.weights, "grads": q.grads, "block": q.block} if q else None),
        "hybrid": {"kind": hy[0], "ranks_per_node": hy[1]} if hy else None,
        "link": ({"gbps": args.link_gbps, "latency_us": args.link_latency_us or 0.0}
                 if args.link_gbps is not None else None),
        "tiers": ({"ranks_per_node": args.ranks_per_node, "intra": args.intra, "inter": args.inter,
                   "nics_per_node": getattr(args, "nics_per_node", None)}     # None: one per GPU
                  if getattr(args, "ranks_per_node", None) is not None else None),
        "seed": args.seed, "start_step": st.start, "resumed_from": st.resumed_from,
        "checkpoints": st.saved, "losses": st.losses, "val_loss": st.val_loss,
        "grad_norms": st.norms, "step_times_s": st.times,
        "units": [{"name": u.name, "numel": u.numel, "padded_numel": u.padded_numel,
                   "shard_numel": u.shard_numel, "padding_in_shard": u.padding_in_shard()}
                  for u in st.strategy.units],
        "memory": {"model_states": measured_state, "model_states_total": sum(measured_state.values()),
                   "padding": padding_bytes(st.strategy.units, stage, args.precision, gd, **ladder),
                   **st.memory, "allocator": st.allocator, "checkpoint": st.checkpoint_memory},
        "theory": {
            "model_states": theory.model_state_bytes(psi, states_n, stage, args.precision,
                                                     grad_dtype=gd, **ladder),
            "model_states_padded": theory.model_state_bytes(psi_padded, states_n, stage,
                                                            args.precision, grad_dtype=gd, **ladder),
            "peak_in_step_padded": theory.peak_step_bytes(psi_padded, states_n, stage,
                                                          args.precision, gd, **ladder),
            "traffic_per_step": (_by_op(tiers.hybrid_traffic_bytes(
                psi, n, hy[1], hy[0], args.precision, A, gd)) if hy else theory.traffic_bytes(
                psi, n, stage, args.precision, grad_op, A, gd)),
            "traffic_per_step_padded": traffic_padded,
            "traffic_per_tier_padded": tiers_padded,     # --hybrid: {"world"|"intra"|"inter": {op: B}}
            "secondary_params_padded": (tiers.hybrid_state_bytes(
                psi_padded, n, hy[1], hy[0], args.precision, gd)["secondary_params"] if hy else None),
        },
        "comm": {"bytes_per_step": comm.bytes_by_op(step=args.steps - 1),
                 "bytes_per_tier": bytes_by_tier(ledger, args.steps - 1), "records": ledger,
                 "time_sources": comm.time_sources()},
        "before_stage": st.leftover,
    })


def _with_offload(st, out: dict) -> dict:
    """--offload-optimizer (zerolab.variants.offload): the model states' formulas become the device's
    (no master, no moments), the host's bytes are added next to theirs ("memory"."host",
    "theory"."host_padded"), and "offload" holds the link, the transfers and each step's split."""
    off = st.strategy.options["offload"]
    out["offload"] = None
    if off is None:
        return out
    args, n, stage, th = st.args, st.comm.world_size, st.stage, out["theory"]
    gd, states = getattr(args, "grad_dtype", None), optimizer_ladder(args)["states"]
    for key, psi in (("", out["num_params"]), ("_padded", out["num_params_padded"])):
        th["model_states" + key] = device_bytes(psi, n, stage, args.precision, gd)
        th["host" + key] = host_bytes(psi, n, args.precision, gd, states)
    th["peak_in_step_padded"] = sum(th["model_states_padded"].values())    # no fp32 copy here
    host = {k: st.memory["current"].get(k, 0) for k in HOST_STATES}
    out["memory"].update(host=host, host_total=sum(host.values()))
    out["offload"] = off.summary(stage, args.precision, gd, states, args.steps - 1)
    return out


def _by_op(per_tier: dict) -> dict[str, float]:
    out = {op: 0.0 for op in theory.RING_FACTOR if op != "all_to_all"}   # + any other used
    for ops in per_tier.values():
        for op, b in ops.items():
            out[op] = out.get(op, 0.0) + b
    return out


def bytes_by_tier(ledger: list[dict], step: int) -> dict[str, dict[str, float]]:
    """Ledger bytes of `step` (grads and params) by the group they ran on - "world" (the whole
    group), "intra" / "inter" (zerolab.variants.tiers' sub-groups) - and by op."""
    out: dict[str, dict[str, float]] = {}
    for r in ledger:
        if r["step"] == step and r["what"] in ("grads", "params"):
            ops = out.setdefault(r.get("tier") or "world", {})
            ops[r["op"]] = ops.get(r["op"], 0.0) + r["bytes"]
    return out


def compare_rows(runs: dict[int, list[dict]]) -> list[dict]:
    """One row per stage, from rank 0 (and the max over ranks for the measured bytes).

    Bytes: model_states (measured after the last step, max over ranks), theory_states (the
    formula at the padded Ψ), theory_states_unpadded (at Ψ), traffic (ledger bytes of the last
    step, grads + params), theory_traffic (formula at the padded Ψ)."""
    rows = []
    for stage, ranks in sorted(runs.items()):
        r0 = ranks[0]
        rows.append({
            "stage": stage, "name": r0["name"], "world_size": r0["world_size"],
            "num_params": r0["num_params"], "final_loss": r0["losses"][-1], "losses": r0["losses"],
            "model_states": max(r["memory"]["model_states_total"] for r in ranks),
            "theory_states": sum(r0["theory"]["model_states_padded"].values()),
            "theory_states_unpadded": sum(r0["theory"]["model_states"].values()),
            "traffic": max(sum(r["comm"]["bytes_per_step"].values()) for r in ranks),
            "theory_traffic": sum(r0["theory"]["traffic_per_step_padded"].values()),
            "peak_tracked": max(r["memory"]["peak_total"] for r in ranks),
            "allocator_peak": max(((r["memory"].get("allocator") or {}).get("peak_absolute") or 0)
                                  for r in ranks),
            "offload": offload_row(ranks) if r0.get("offload") else None,
        })
    return rows


def offload_row(ranks: list[dict]) -> dict:
    """--offload-optimizer's figures of one stage: host bytes (max over ranks) and formula,
    bytes down / up in the last step (max over ranks) and formula, and rank 0's seconds per
    step - down, host (the casts, the norm, AdamW), up, and the rest of the step (forward,
    backward, collectives) - as the median over the steps but the first (warm-up) and the last
    (run under the allocator cross-check), where there are others."""
    r0, off = ranks[0], ranks[0]["offload"]
    steps = list(zip(off["steps"], r0["step_times_s"][-len(off["steps"]):]))
    steps = steps[1:-1] or steps[1:] or steps
    split = {k: statistics.median(s[k] for s, _ in steps) for k in ("down_s", "host_s", "up_s")}
    split["rest_s"] = statistics.median(t - s["down_s"] - s["host_s"] - s["up_s"]
                                        for s, t in steps)
    return {"host": max(r["memory"]["host_total"] for r in ranks),
            "theory_host": sum(r0["theory"]["host_padded"].values()),
            **{d: max(r["offload"]["bytes_per_step"][d] for r in ranks) for d in ("down", "up")},
            **{"theory_" + d: off["bytes_per_step_formula"][d] for d in ("down", "up")},
            "link": (off["link"] or {}).get("name"), "emulated": off["emulated"], **split}


def format_rows(rows: list[dict]) -> str:
    """The comparison as a text table (bytes per rank)."""
    head = (f"{'stage':<8}{'final loss':>11}{'model states':>14}{'formula':>12}{'ratio':>7}"
            f"{'bytes/step':>12}{'formula':>12}{'ratio':>7}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['name']:<8}{r['final_loss']:>11.6f}{r['model_states']:>14,.0f}"
                     f"{r['theory_states']:>12,.0f}{_ratio(r['model_states'], r['theory_states']):>7}"
                     f"{r['traffic']:>12,.0f}{r['theory_traffic']:>12,.0f}"
                     f"{_ratio(r['traffic'], r['theory_traffic']):>7}")
        o = r.get("offload")
        if o:                               # --offload-optimizer: the host's side
            how = f"emulated {o['link']}" if o["emulated"] else "real"
            lines.append(
                f"{'  host':<8}{'':>11}{o['host']:>14,.0f}{o['theory_host']:>12,.0f}"
                f"{_ratio(o['host'], o['theory_host']):>7}  PCIe down {o['down']:,.0f} + up "
                f"{o['up']:,.0f} (formula {o['theory_down']:,.0f} + {o['theory_up']:,.0f}), {how}")
            lines.append(f"{'  time':<8}  median step: transfers "
                         f"{(o['down_s'] + o['up_s']) * 1e3:.1f} ms, host update "
                         f"{o['host_s'] * 1e3:.1f} ms, the rest (forward, backward, "
                         f"collectives) {o['rest_s'] * 1e3:.1f} ms")
    return "\n".join(lines)


def _ratio(a, b):
    return f"{a / b:.3f}" if b else ("1.000" if a == b else "inf")
