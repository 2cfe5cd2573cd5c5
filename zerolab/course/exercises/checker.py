"""The exercise checker: load a learner's functions, run them inside zerolab's strategy on N gloo
ranks, compare with the single-process torch reference and the formulas, explain the first fault.

Checks, in the order a learner meets them (the first failing one is reported, with every rank
that failed it):
1. the file loads and defines the functions of the skeleton, with the skeleton's arguments, and
   none of them is still blank (`raise NotImplementedError`): no ranks are started otherwise;
2. without ranks (`diagnose.probe`): shard_range's (start, stop) for numel 1..40 and a few large
   ones, N = 1..8, every rank; ZeRO-1's own_gradient on a bf16 unit (the fp32 conversion);
3. on N ranks (`sandbox.run_ranks`: gloo on loopback): train zerolab's strategy of that
   stage on the GPT "nano" (the odd-sized toy model for shard_range) in fp32, 3 optimizer steps
   of 2 micro-steps each, global gradient clipping at 0.5, and after every step compare
   - every parameter on every rank with `zerolab.course.testing.reference` (torch's AdamW on the whole
     global batch, no zerolab code) within 1e-6, and the global gradient norm within rel 2e-6,
     as tests/test_equivalence.py does (the norm matters: AdamW after clipping is blind to a
     gradient that is n times too large, i.e. summed instead of averaged);
   - the bytes each rank sent that step (the comm ledger) with `theory.traffic_bytes`, and the
     bytes it holds by state with `theory.model_state_bytes`, both at the padded Ψ, exactly, as
     tests/test_measure.py does;
   - stage-specific: DDP's all_reduces run during backward, one per bucket; ZeRO-2/3 hold no
     full-gradient bucket after backward; ZeRO-3 holds no gathered block after forward or step;
   - the learner's functions, watched while they run (`watch.instrument`): the collectives
     they start and on which of unit's buffers, a tensor changed while its collective was in
     flight, the handle they return, the result against the right one and the usual wrong ones.
     Such a named mistake is reported first, with the learner's function and line, and the
     measured findings as evidence.
The learner's code runs in children only (sandbox.py): steps 1-2 in a fork of this process, the
judge, step 3 on the ranks; this process decides. A check passes only when each of the learner's
functions was called on every rank and every rank compared every step (`outcome.unrun`); else
one line says what happened (`outcome.failure`): the file exited at import, a rank exited or
raised inside a function (with the line of the learner's file), a call did not return within
`call_timeout` seconds (CALL_TIMEOUT, `--call-timeout`: every process is stopped, the function
named), or the whole check passed `timeout` seconds.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import diagnose, outcome, sandbox, watch
from .table import EXERCISES, RANK_FREE
from ..testing import RanksFailed

ATOL = 1e-6                 # fp32, as tests/test_equivalence.py (see its comment on lr 1e-4)
STEPS, ACCUM, ROWS, MAX_NORM = 3, 2, 1, 0.5
CALL_TIMEOUT = 20.0         # s: one call of a learner's function (each takes milliseconds)
MORE = "zerolab.course.exercises.more"


class ImplError(Exception):
    """The learner's file can't be used as it is: one line saying why and what to do."""


@dataclass
class Result:
    """The verdict. ok: passed every check. lines: the message, one finding per line."""
    exercise: str
    impl: str
    nproc: int
    ok: bool = False
    lines: list[str] = field(default_factory=list)
    seconds: float = 0.0
    diagnosed: bool = False     # the lines name the mistake (zerolab.course.exercises.diagnose)

    def text(self) -> str:
        ex = EXERCISES[self.exercise]
        head = (f"zerolab check {ex.name}: exercise ({ex.letter}) {ex.title}\n"
                f"  your code: {self.impl}; "
                + (f"{self.nproc} gloo ranks; " if ex.name not in ("groups", "owner_assignment")
                   else "")                 # (f) and (k) start none
                + f"{self.seconds:.1f} s")
        verdict = "PASS" if self.ok else "FAIL"
        body = "\n".join(f"  {line}" for line in self.lines)
        stuck = (f"\n  stuck? hints one at a time: zerolab check {ex.name} --hint [K] (notebook: "
                 f"exercises.hint(\"{ex.name}\", K))")
        tips = "" if self.ok else stuck if self.diagnosed else \
            "\n  usual mistakes:\n" + "\n".join(f"    - {h}" for h in ex.hints) + stuck
        return f"{head}\n{verdict}\n{body}{tips}"


# --- loading the learner's code ---------------------------------------------------------------
def load_impl(impl: str, name: str):
    """The module `impl` names: a .py file (loaded under a private name) or a dotted module."""
    path = Path(impl)
    if impl.endswith(".py") or os.sep in impl or path.exists():
        if not path.is_file():
            raise ImplError(f"{impl}: no such file (run the %%writefile cell first, or give the "
                            f"path of your .py file)")
        spec = importlib.util.spec_from_file_location(f"zerolab_learner_{name}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            with sandbox.marking("import"):         # an exit here: "exited at import"
                spec.loader.exec_module(module)
        except SyntaxError as err:
            raise ImplError(f"{impl} line {err.lineno}: SyntaxError: {err.msg}") from None
        except Exception as err:  # noqa: BLE001 - the learner's import-time error, in one line
            raise ImplError(f"{impl} fails when imported: {type(err).__name__}: {err}") from None
        return module
    try:
        return importlib.import_module(impl)
    except ImportError as err:
        raise ImplError(f"{impl!r} is neither a .py file nor an importable module ({err})") from None


def _raises_not_implemented(fn) -> bool:
    if inspect.isclass(fn):                 # the track's classes: any method still blank
        return any(_raises_not_implemented(m) for m in vars(fn).values() if inspect.isfunction(m))
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(target, ast.Name) and target.id == "NotImplementedError":
                return True
    return False


def learner_functions(ex, impl: str) -> dict:
    """{name: function} of exercise `ex` from `impl`; ImplError when one is missing, has other
    arguments than the skeleton's, or is still blank."""
    module = load_impl(impl, ex.name)
    skeleton = load_impl(str(ex.skeleton), ex.name + "_skeleton")
    out, blank = {}, []
    for fname in ex.functions:
        want = list(inspect.signature(getattr(skeleton, fname)).parameters)
        fn = getattr(module, fname, None)
        if not callable(fn):
            raise ImplError(f"{impl} defines no function {fname}({', '.join(want)}): keep the "
                            f"skeleton's name")
        got = list(inspect.signature(fn).parameters)
        if len(got) != len(want):
            raise ImplError(f"{fname} takes ({', '.join(got)}); the checker calls it with "
                            f"({', '.join(want)}): keep the skeleton's arguments")
        if _raises_not_implemented(fn):
            blank.append(fname)
        out[fname] = fn
    if blank:
        raise ImplError(f"{' and '.join(blank)} still raise{'s' if len(blank) == 1 else ''} "
                        f"NotImplementedError (the blank skeleton): write the body in your "
                        f"%%writefile cell (or {impl}), run that cell, then check again")
    return out


def install(ex, functions: dict):
    """Put the learner's functions in place of the package's (the strategy looks them up by
    module-level name when it calls them)."""
    module = importlib.import_module(ex.module)
    for fname, fn in functions.items():
        setattr(module, fname, fn)


# --- (a) shard_range without ranks -------------------------------------------------------------
def check_shard_range_alone(fn) -> list[str]:
    """The table of (numel, N) cases, wrong ranges classified: `diagnose.shard_range_problem`."""
    return diagnose.shard_range_problem(fn)


# --- inside each rank ---------------------------------------------------------------------------
def check_worker(rank, n, name, impl):
    """Runs on every rank: install the learner's functions, train, compare. Returns a list of
    findings {"step", "rank", "kind", "text", "diagnosis"} (empty: all equal; diagnosis: a
    mistake named by zerolab.course.exercises.diagnose) and the largest parameter diff."""
    notes, found, before = diagnose.Notes(), [], sandbox.calls()
    try:
        out = _check_run(rank, n, name, impl, notes, found)
    except diagnose.Mistake as err:         # going on would crash zerolab: every rank stops
        found += [{"step": notes.step, "rank": rank, "kind": kind, "text": text, "diagnosis": True}
                  for kind, text in [(err.kind, err.text), *notes.drain()]]
        _any_rank(True)
        out = {"findings": found, "worst": 0.0, "psi": 0, "compared": 0}
    # the learner's calls during this check (sandbox.marked counts them): outcome.unrun
    out["calls"] = {k: v - before.get(k, 0) for k, v in sandbox.calls().items()}
    return out


def _check_run(rank, n, name, impl, notes, found):
    from ... import theory
    from ...variants.compose import make_strategy
    from .. import testing
    from ...comm import Comm
    from ...loop.guards import ShardedGrad
    from ...memory import MemoryMeter

    ex = EXERCISES[name]
    install(ex, watch.instrument(name, sandbox.marked(learner_functions(ex, impl)), notes))
    job = dict(model=ex.model, precision="fp32", grad_accum=ACCUM, rows_per_micro=ROWS,
               max_norm=MAX_NORM)
    ref = testing.reference(job, n, STEPS, history=True)
    _any_rank(False)                        # together from here: call_timeout is per call
    model = testing.make_model(ex.model)
    before = {k: p.detach().float().clone() for k, p in model.named_parameters()}
    comm, meter = Comm(), MemoryMeter()
    # ZeRO-3 without prefetch: every block's gather then goes through the learner's gather_params
    # (a prefetched gather is issued by the strategy itself)
    kwargs = {"prefetch": 0} if ex.stage == 3 else {}
    s = make_strategy(ex.stage, model, comm, max_grad_norm=MAX_NORM, lr=testing.LR,
                      weight_decay=testing.WD, meter=meter, **kwargs)
    psi = sum(u.padded_numel for u in s.units)
    worst, compared = 0.0, 0

    def finding(step, kind, text, diagnosis=False):
        found.append({"step": step, "rank": rank, "kind": kind, "text": text,
                      "diagnosis": diagnosis})

    def noted(step):                        # what the watched functions did wrong, named
        for kind, text in notes.drain():
            finding(step, kind, text, diagnosis=True)

    for step in range(STEPS):
        comm.step = notes.step = step
        meter.reset_peaks()
        x, y = testing.global_batch(model, step, n * ACCUM * ROWS)
        for micro in range(ACCUM):
            rows = slice((rank * ACCUM + micro) * ROWS, (rank * ACCUM + micro + 1) * ROWS)
            loss = s.forward(x[rows], y[rows])
            if ex.stage == 3:
                held = [(u.name, u.param_flat.untyped_storage().nbytes()) for u in s.units
                        if u.module is not None and u.param_flat.untyped_storage().nbytes()]
                if held:
                    finding(step, "memory", f"after forward (micro-step {micro + 1}) the full "
                            f"parameters of {held[0][0]} ({held[0][1]:,} bytes) are still "
                            f"gathered: free_params must release them")
            # the course's loop (run/stage.py): ZeRO-2/3 reduce-scatter every micro-step, so
            # that the full gradient never outlives its block (sync=False would keep it)
            s.backward(loss / ACCUM, sync=micro == ACCUM - 1 or ex.stage >= 2)
            noted(step)
            if ex.stage in (2, 3):
                held = [u.name for u in s.units if u.bucket is not None
                        or any(p.grad is not None and type(p.grad) is not ShardedGrad
                               for p in u.params)]
                if held:
                    finding(step, "memory", f"after backward (micro-step {micro + 1}) the "
                            f"full-gradient bucket of {held[0]} is still alive (unit.bucket or a "
                            f"p.grad view of it): free it once its reduce_scatter is done")
        norm = float(s.step())
        noted(step)
        meter.sample(s, "checked")
        # --- the global gradient norm clip_grad_norm_ saw (AdamW after clipping hides a scale) -
        want_norm = ref["norms"][step]
        if abs(norm - want_norm) > 2e-6 * abs(want_norm):          # test_equivalence's rel 2e-6
            ratio = norm / want_norm
            why = diagnose.norm_advice(name, ratio, n)
            finding(step, "gradient norm", f"global gradient norm {norm:.7g}, expected "
                    f"{want_norm:.7g} (torch's clip_grad_norm_ on the global batch), "
                    f"{ratio:.3g} x: {why}")
        # --- bytes sent this step: the ledger against the formula --------------------------
        sent = comm.bytes_by_op(step=step)
        want = theory.traffic_bytes(psi, n, ex.stage, "fp32", grad_accum=ACCUM)
        for op, b in want.items():
            if abs(sent[op] - b) > 1e-6 * max(b, 1):
                finding(step, "bytes sent", f"{op} sent {sent[op]:,.0f} bytes, formula "
                        f"{b:,.0f} (theory.traffic_bytes, Ψ = {psi:,} padded, fp32, "
                        f"{ACCUM} micro-steps)")
        if ex.stage == 0:
            during = [r for r in comm.records if r.step == step and r.op == "all_reduce"
                      and r.what == "grads"]
            if len(during) != len(s.units) or any(r.phase != "backward" for r in during):
                finding(step, "hook", f"{len(during)} all_reduce(s) of gradients, phases "
                        f"{sorted({r.phase for r in during})}; expected one per bucket "
                        f"({len(s.units)}), all during backward (from the hook)")
        # --- bytes held: the meter against the formula --------------------------------------
        held = theory.model_state_bytes(psi, n, ex.stage, "fp32")
        for state, b in held.items():
            if meter.current.get(state, 0) != b:
                finding(step, "bytes held", f"holds {meter.current.get(state, 0):,} bytes of "
                        f"{state} after the step, formula {b:,.0f} (theory.model_state_bytes)")
        if ex.stage == 3 and meter.current.get("gathered_params", 0):
            finding(step, "memory", f"{meter.current['gathered_params']:,} bytes of gathered "
                    f"parameters are still held after the step: free_params must free them")
        # --- parameters: against the single-process torch reference -------------------------
        got = s.full_parameters()
        worst = max(worst, testing.max_param_diff(got, ref["history"][step]))
        diff = testing.first_difference(got, ref["history"][step], ATOL)
        if diff is not None:
            pname, index, expected, value, largest = diff
            where = f"{pname}[{', '.join(map(str, index))}]" if index else pname
            old = before[pname][index].item() if index else before[pname].item()
            advice = diagnose.param_advice(name, stale=value == old != expected)
            finding(step, "parameters", f"parameter {where} = {value:.7g}, expected "
                    f"{expected:.7g} (single-process torch AdamW on the same global batch); "
                    f"largest difference {largest:.2g} > {ATOL:g}" + (f": {advice}" if advice
                                                                       else ""))
        before = ref["history"][step]
        compared += 1
        if _any_rank(bool(found)):
            break                           # the first step that differs is the one to fix
    return {"findings": found, "worst": worst, "psi": psi, "compared": compared}


def _any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on some rank (so that all ranks stop together).
    Plain torch.distributed, outside the ledger."""
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def check_many_worker(rank, n, pairs):
    """check_worker for each (name, impl) in turn, restoring the package's functions after each
    (used by the tests to grade several implementations in one group of ranks)."""
    import torch.distributed as dist
    out = []
    for name, impl in pairs:
        module = importlib.import_module(EXERCISES[name].module)
        saved = {f: getattr(module, f) for f in EXERCISES[name].functions}
        try:
            out.append(check_worker(rank, n, name, impl))
        finally:
            for f, fn in saved.items():
                setattr(module, f, fn)
        dist.barrier()
    return out


# --- in the parent ------------------------------------------------------------------------------
def _judged(name: str, impl: str, nproc: int, timeout: float) -> dict:
    """In the judge (sandbox.judge, a fork): load and check the learner's file, grade what needs
    no rank. JSON: {"error": line} | {"ok", "lines", "diagnosed"} (graded) | {"measure": worker}
    (more.py wants a measured run first) | {} (start the ranks)."""
    ex = EXERCISES[name]
    try:
        functions = sandbox.marked(learner_functions(ex, impl))
    except ImplError as err:
        return {"error": str(err)}
    if ex.grader in RANK_FREE:              # (f)-(h), (k): rank-free, runs measured here
        more = importlib.import_module(ex.grader)
        try:
            ok, lines = more.grade(name, functions, impl, nproc, timeout)
        except getattr(more, "Unmeasured", ()) as err:
            return {"measure": err.args[0]}
        return {"ok": ok, "lines": lines,      # (k) names the rule it recognised: "why: ..."
                "diagnosed": any(line.startswith("why: ") for line in lines)}
    problems = [] if ex.grader else diagnose.probe(name, functions)     # shard_range, own_gradient
    return {"ok": False, "lines": problems, "diagnosed": True} if problems else {}


def _judge(name: str, impl: str, nproc: int, timeout: float, call_timeout: float):
    """(the judge's answer, its calls of the learner's functions); the runs more.py measures are
    taken here, in the checking process, then the judge runs again. Raises sandbox.Failed."""
    while True:
        answer, calls = sandbox.judge(_judged, name, impl, nproc, timeout, timeout=timeout,
                                      call_timeout=call_timeout)
        if "measure" not in answer:
            return answer, calls
        problem = importlib.import_module(MORE).measure(answer["measure"], nproc, timeout)
        if problem:
            return {"ok": False, "lines": [problem], "diagnosed": False}, calls


def run_check(name: str, impl: str, nproc: int = 3, timeout: float = 90.0,
              call_timeout: float = CALL_TIMEOUT) -> Result:
    """Check `impl` for exercise `name` on `nproc` (2-4) gloo ranks; see the module docstring.
    timeout: seconds for the whole check; call_timeout: for one call of a learner's function."""
    if name not in EXERCISES:
        raise ValueError(f"exercise {name!r} is not one of {', '.join(EXERCISES)}")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or not 2 <= nproc <= 4:
        raise ValueError(f"nproc {nproc!r} must be 2, 3 or 4")
    for what, value in (("timeout", timeout), ("call_timeout", call_timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{what} {value!r} must be a number of seconds > 0")
    ex, t0 = EXERCISES[name], time.monotonic()
    result = Result(name, impl, nproc)

    def done(ok, lines, diagnosed=False):
        result.ok, result.lines, result.seconds = ok, lines, time.monotonic() - t0
        result.diagnosed = diagnosed
        return result

    try:
        answer, calls = _judge(name, str(impl), nproc, timeout, call_timeout)
        if "error" in answer:
            return done(False, [answer["error"]])
        if "lines" in answer:               # only (f)-(h) can pass without ranks
            ok = answer["ok"] is True and ex.grader in RANK_FREE
            unrun = outcome.unrun(ex.functions, [calls], ranks=False) if ok else []
            return done(ok and not unrun, unrun or answer["lines"],
                        answer["diagnosed"] or bool(unrun))
        if ex.grader:                       # (i)-(j): graded on ranks by track.py
            return done(*importlib.import_module(ex.grader).grade(name, str(impl), nproc,
                                                                     timeout, call_timeout))
        per_rank = sandbox.run_ranks(check_worker, nproc, name, str(impl), timeout=timeout,
                                     call_timeout=call_timeout)
    except RanksFailed as err:
        return done(False, *outcome.failure(err, impl))
    return outcome.verdict(done, [r["result"] for r in per_rank], ex, STEPS, ACCUM, ATOL)


def run_checks(pairs, nproc: int = 3, timeout: float = 120.0) -> list[Result]:
    """Results for several (exercise, impl) pairs graded in ONE group of ranks: quicker, for
    implementations known to load and not to raise (the package's and the tests' variants);
    impls that fail before ranks start are graded without them."""
    t0, results, launch = time.monotonic(), [], []
    for name, impl in pairs:
        ex, result = EXERCISES[name], Result(name, impl, nproc)
        if ex.grader and ex.grader not in RANK_FREE:    # the track: one at a time (track.grade_many)
            results.append(run_check(name, impl, nproc, timeout))
            continue
        answer, calls = _judge(name, str(impl), nproc, timeout, CALL_TIMEOUT)
        if "error" in answer:
            result.lines = [answer["error"]]
        elif "lines" in answer:
            result.ok, result.lines = answer["ok"], answer["lines"]
            result.diagnosed = answer["diagnosed"]
        else:
            launch.append(len(results))
        results.append(result)
    per_item = [r["result"] for r in sandbox.run_ranks(
        check_many_worker, nproc, [pairs[i] for i in launch], timeout=timeout,
        call_timeout=CALL_TIMEOUT)] if launch else []
    for k, i in enumerate(launch):
        res = results[i]

        def done(ok, lines, diagnosed=False, res=res):
            res.ok, res.lines, res.diagnosed = ok, lines, diagnosed
            return res
        outcome.verdict(done, [rank_out[k] for rank_out in per_item], EXERCISES[res.exercise],
                        STEPS, ACCUM, ATOL)
    for res in results:
        res.seconds = time.monotonic() - t0
    return results
