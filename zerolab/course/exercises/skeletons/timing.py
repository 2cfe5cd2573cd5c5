# Exercise (h): how long a ring collective takes - the α-β model - then measured on a link.
# Check: zerolab check timing --impl my_timing.py
# A ring collective on n ranks is a sequence of ring steps; each costs the link's latency α
# (link.latency, seconds per ring step), and each rank pushes its share of the data through the
# link's bandwidth β (link.bandwidth, BYTES per second per rank and direction). size_bytes S is
# the full (unsharded) array. Ops: "all_reduce", "reduce_scatter", "all_gather", "broadcast"
# (pipelined along the ring: n-1 steps of latency, every rank forwards every byte once).
# notebooks/03_collectives.ipynb counts the steps and the bytes of the others.
# The check compares with zerolab's cost model on many cases, then times real collectives on
# gloo ranks over zerolab's emulated link (zerolab.timing.linkemu) against your predictions.


def ring_time(op: str, size_bytes: float, n: int, link) -> float:
    """Seconds for a ring `op` of S = size_bytes bytes on n ranks over `link` (a
    zerolab.timing.hardware.Link: .bandwidth bytes/s, .latency s per ring step)."""
    raise NotImplementedError("write ring_time: latency steps plus bytes over bandwidth")
