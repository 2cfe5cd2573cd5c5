"""The exercise checker: load a learner's functions, run them inside zerolab's strategy on N gloo
ranks, compare with the single-process torch reference and the formulas, explain the first fault.

Checks, in the order a learner meets them (the first failing one is reported, with every rank
that failed it):
1. the file loads and defines the functions of the skeleton, with the skeleton's arguments, and
   none of them is still blank (`raise NotImplementedError`): no ranks are started otherwise;
2. without ranks (`diagnose.probe`): shard_range's (start, stop) for numel 1..40 and a few large
   ones, N = 1..8, every rank; ZeRO-1's own_gradient on a bf16 unit (the fp32 conversion);
3. on N ranks (`zerolab.course.testing.run_ranks`, with a timeout): train zerolab's strategy of that
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
A rank that raises is reported with the line of the learner's file it raised in; a run that
hangs (a collective not every rank issued) is killed after `timeout` seconds.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import re
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import EXERCISES, diagnose, watch

ATOL = 1e-6                 # fp32, as tests/test_equivalence.py (see its comment on lr 1e-4)
STEPS, ACCUM, ROWS, MAX_NORM = 3, 2, 1, 0.5


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
                + (f"{self.nproc} gloo ranks; " if ex.name != "groups" else "")      # (f) starts none
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
    notes, found = diagnose.Notes(), []
    try:
        return _check_run(rank, n, name, impl, notes, found)
    except diagnose.Mistake as err:         # going on would crash zerolab: every rank stops
        found += [{"step": notes.step, "rank": rank, "kind": kind, "text": text, "diagnosis": True}
                  for kind, text in [(err.kind, err.text), *notes.drain()]]
        _any_rank(True)
        return {"findings": found, "worst": 0.0, "psi": 0}


def _check_run(rank, n, name, impl, notes, found):
    from ... import STRATEGIES, theory
    from .. import testing
    from ...comm import Comm
    from ...guards import ShardedGrad
    from ...memory import MemoryMeter

    ex = EXERCISES[name]
    install(ex, watch.instrument(name, learner_functions(ex, impl), notes))
    job = dict(model=ex.model, precision="fp32", grad_accum=ACCUM, rows_per_micro=ROWS,
               max_norm=MAX_NORM)
    ref = testing.reference(job, n, STEPS, history=True)
    model = testing.make_model(ex.model)
    before = {k: p.detach().float().clone() for k, p in model.named_parameters()}
    comm, meter = Comm(), MemoryMeter()
    # ZeRO-3 without prefetch: every block's gather then goes through the learner's gather_params
    # (a prefetched gather is issued by the strategy itself)
    kwargs = {"prefetch": 0} if ex.stage == 3 else {}
    s = STRATEGIES[ex.stage](model, comm, max_grad_norm=MAX_NORM, lr=testing.LR,
                             weight_decay=testing.WD, meter=meter, **kwargs)
    psi = sum(u.padded_numel for u in s.units)
    worst = 0.0

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
        if _any_rank(bool(found)):
            break                           # the first step that differs is the one to fix
    return {"findings": found, "worst": worst, "psi": psi}


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
def _rank_error(err, impl: str) -> list[str]:
    """One or two lines from the ranks' reports: which rank raised, where in the learner's file."""
    name = Path(impl).name
    for rank, text in sorted(err.ranks.items()):
        if "Traceback" not in text:
            continue
        last = text.strip().splitlines()[-1]
        if last.startswith(f"{diagnose.__name__}.Mistake: "):    # a named mistake, as is
            return [last.partition(": ")[2]]
        frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', text)
        mine = [f for f in frames if Path(f[0]).name == name]
        where = f" in your {mine[-1][2]} ({name} line {mine[-1][1]})" if mine else ""
        return [f"rank {rank} raised{where}: {last}"]
    if "timed out" in err.why:
        stuck = []
        for rank, text in sorted(err.ranks.items()):
            frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', text)
            mine = [f for f in frames if Path(f[0]).name == name]
            if mine:
                stuck.append(f"rank {rank} was waiting in your {mine[0][2]} ({name} line "
                             f"{mine[0][1]})")
        return [f"the ranks did not finish: {err.why}. A collective that not every rank "
                f"issued, or a wait that never ends, hangs the others.", *stuck]
    return [err.why]


def run_check(name: str, impl: str, nproc: int = 3, timeout: float = 90.0) -> Result:
    """Check `impl` for exercise `name` on `nproc` (2-4) gloo ranks; see the module docstring."""
    from .. import testing

    if name not in EXERCISES:
        raise ValueError(f"exercise {name!r} is not one of {', '.join(EXERCISES)}")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or not 2 <= nproc <= 4:
        raise ValueError(f"nproc {nproc!r} must be 2, 3 or 4")
    ex, t0 = EXERCISES[name], time.monotonic()
    result = Result(name, impl, nproc)

    def done(ok, lines, diagnosed=False):
        result.ok, result.lines, result.seconds = ok, lines, time.monotonic() - t0
        result.diagnosed = diagnosed
        return result

    try:
        functions = learner_functions(ex, impl)
    except ImplError as err:
        return done(False, [str(err)])
    if ex.grader:                           # (f)-(j): graded by their own module (more, track)
        return done(*importlib.import_module(ex.grader).grade(name, functions, str(impl),
                                                                 nproc, timeout))
    problems = diagnose.probe(name, functions)     # without ranks: shard_range, own_gradient
    if problems:
        return done(False, problems, diagnosed=True)
    try:
        per_rank = testing.run_ranks(check_worker, nproc, name, str(impl), timeout=timeout)
    except testing.RanksFailed as err:
        return done(False, _rank_error(err, impl))
    return _verdict(done, per_rank)


def run_checks(pairs, nproc: int = 3, timeout: float = 120.0) -> list[Result]:
    """Results for several (exercise, impl) pairs graded in ONE group of ranks: quicker, for
    implementations known to load and not to raise (the package's and the tests' variants);
    impls that fail before ranks start are graded without them."""
    from .. import testing
    t0, results, launch = time.monotonic(), [], []
    for name, impl in pairs:
        if EXERCISES[name].grader:          # (f)-(j): one at a time (tests: track.grade_many)
            results.append(run_check(name, impl, nproc, timeout))
            continue
        result = Result(name, impl, nproc)
        try:
            functions = learner_functions(EXERCISES[name], impl)
            problems = diagnose.probe(name, functions)
            result.diagnosed = bool(problems)
        except ImplError as err:
            problems = [str(err)]
        if problems:
            result.lines = problems
        else:
            launch.append(len(results))
        results.append(result)
    per_item = testing.run_ranks(check_many_worker, nproc,
                                 [pairs[i] for i in launch], timeout=timeout) if launch else []
    for k, i in enumerate(launch):
        res = results[i]

        def done(ok, lines, diagnosed=False, res=res):
            res.ok, res.lines, res.diagnosed = ok, lines, diagnosed
            return res
        _verdict(done, [rank_out[k] for rank_out in per_item])
    for res in results:
        res.seconds = time.monotonic() - t0
    return results


def _verdict(done, per_rank) -> Result:
    found = [f for r in per_rank for f in r["findings"]]
    if found:
        first = min(f["step"] for f in found)
        lines = [f"step {first + 1} of {STEPS} (each {ACCUM} micro-steps), the first that differs:"]
        at_first = [f for f in found if f["step"] == first]
        named = any(f.get("diagnosis") for f in at_first)
        ranks_by_line: dict[tuple, list[int]] = {}      # one line per finding, ranks grouped
        # the mistakes diagnose named first (what to fix), then what the checks measured
        for f in sorted(at_first, key=lambda f: (not f.get("diagnosis"), f["rank"])):
            ranks = ranks_by_line.setdefault((f["kind"], f["text"], bool(f.get("diagnosis"))), [])
            if f["rank"] not in ranks:
                ranks.append(f["rank"])
        kinds_shown, measured = set(), 0
        for (kind, text, diagnosis), ranks in ranks_by_line.items():
            if (kind, tuple(ranks)) in kinds_shown:
                continue                                 # the first of each kind is enough
            if named and not diagnosis:
                measured += 1
                if measured > 2:                         # the evidence, briefly
                    continue
            kinds_shown.add((kind, tuple(ranks)))
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
            lines.append(f"{who}: {kind}: {text}")
        return done(False, lines, diagnosed=named)
    worst = max(r["worst"] for r in per_rank)
    return done(True, [
        f"every parameter on every rank equals single-process torch AdamW after each of "
        f"{STEPS} steps (largest difference {worst:.2g} <= {ATOL:g})",
        f"bytes sent and bytes held equal the formulas at Ψ = {per_rank[0]['psi']:,} (padded) "
        f"on every rank, every step"])
