def assign_owners(shapes, world_size):
    """Largest first, least loaded, but a tie goes to the highest rank (<= instead of <)."""
    numel = []
    for shape in shapes:
        k = 1
        for d in shape:
            k *= d
        numel.append(k)
    loads, owners = [0] * world_size, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: -numel[i]):
        best = 0
        for r in range(world_size):
            if loads[r] <= loads[best]:
                best = r
        owners[i] = best
        loads[best] += numel[i]
    return owners
