# Exercise (k): the owner of each whole matrix (notebook 08b; zerolab/wholematrix/muon_owner.py).
# Check: zerolab check owner_assignment --impl my_owner_assignment.py
# Muon, Adafactor and LAMB read a parameter's whole matrix, so a sharded optimizer gives every
# parameter to ONE rank, its owner, which keeps its state and steps it whole. torch's
# ZeroRedundancyOptimizer (and zerolab's owner layout) place them greedily by size:
#   - take the parameters largest first, counting ALL of a parameter's elements (numel: the
#     product of its shape; a 0-d parameter has 1); equal sizes keep their order in the list;
#   - give each to the rank that owns the fewest elements so far; on a tie, the lowest rank.
# Return the owning rank of each parameter, in the order of `shapes` (not in the sorted order).


def assign_owners(shapes, world_size: int):
    """shapes: one tuple of ints per parameter (e.g. [(768, 3072), (768,), (50304, 768)]);
    world_size: ranks (>= 1). Returns a list of len(shapes) ints in 0..world_size-1: for
    [(4, 4), (2, 2), (3, 3)] on 2 ranks, [0, 1, 1] (16 -> rank 0, 9 -> rank 1, 4 -> rank 1)."""
    raise NotImplementedError("write assign_owners: largest first, each to the least-loaded rank")
