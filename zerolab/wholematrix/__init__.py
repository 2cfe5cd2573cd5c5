"""Optimizers that read whole matrices (Muon, Adafactor, LAMB), which ZeRO's flat ranges cannot
step, and the three layouts that make each matrix whole somewhere. They stand on comm only.

    muon_theory     owners (greedy by size), bytes, Newton-Schulz FLOPs and held bytes per layout
    wholeopt        the layouts' frame: the AdamW fallback split, reduce / route / update /
                    route_back
    muon_owner      whole parameters owned by ranks (torch's ZeroRedundancyOptimizer's partition)
    muon_a2a        dim-0 shards sent to each matrix's owner and back with all_to_all (torchtitan)
    muon_replicate  every gradient gathered, every rank steps every matrix
    lamb            LAMB written from its paper (You et al. 2020, Algorithm 2), a torch optimizer:
                    an `optimizer_class` for MuonOwner and MuonReplicate (it reads a whole norm)
    factored        torch's Adafactor on dim-0 row shards, its row/column sums all-reduced: the
                    cheap case of an optimizer that is not element-wise (zerolab.torchlike.Adafactor)

`make_muon(params, layout)` (variants/compose.py) picks a layout by name.
"""
from .lamb import Lamb
from .muon_a2a import MuonAllToAll
from .muon_owner import MuonOwner
from .muon_replicate import MuonReplicate

__all__ = ["Lamb", "MuonAllToAll", "MuonOwner", "MuonReplicate"]
