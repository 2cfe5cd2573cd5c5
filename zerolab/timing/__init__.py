"""The time side: what a step costs in seconds, modelled and measured.

    hardware    links (β bytes/s, α s per ring step) and devices (FLOP/s), with their sources;
                two tiers (Topology: nodes of k ranks, an intra and an inter link)
    flops       FLOPs per token (6Ψ + 12·L·d·s, attention included) and compute time at F · MFU
    collectives one collective's α-β time: rings (and tree) on one link, or on two tiers (flat /
                hierarchical, bytes per tier, per-tier clocks)
    costmodel   a step replayed per stage on either network; collectives and flops re-exported
    timetable   the `zerolab time` table: every stage replayed, ZeRO-3's threshold by MFU
    linkemu     an emulated network link for gloo runs: a collective ends no sooner than the model;
                two tiers: each collective timed by the tiers its group crosses
    tiercheck   the two-tier emulator measured against the model on 4 gloo ranks (its margins)
    trace       one step of a rank as a Chrome / Perfetto trace; reading it back
    whatif      one rank of a world of 1024 on torch's fake process group

It imports only the lesson (the top of zerolab/); the training run plugs the link emulator and the
traces into it (zerolab.run.stage), notebook 12 and lab 6 read it.
"""
