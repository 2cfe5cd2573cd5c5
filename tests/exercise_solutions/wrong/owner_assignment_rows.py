def assign_owners(shapes, world_size):
    """Sorted by the number of rows (shape[0]) instead of all the elements."""
    numel = []
    for shape in shapes:
        k = 1
        for d in shape:
            k *= d
        numel.append(k)
    rows = [shape[0] if shape else 1 for shape in shapes]
    loads, owners = [0] * world_size, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: -rows[i]):
        r = loads.index(min(loads))
        owners[i] = r
        loads[r] += numel[i]
    return owners
