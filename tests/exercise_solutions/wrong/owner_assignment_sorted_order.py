def assign_owners(shapes, world_size):
    """Right placement, but the owners are returned in size order, not in the order of shapes."""
    numel = []
    for shape in shapes:
        k = 1
        for d in shape:
            k *= d
        numel.append(k)
    loads, owners = [0] * world_size, []
    for i in sorted(range(len(shapes)), key=lambda i: -numel[i]):
        r = loads.index(min(loads))
        owners.append(r)
        loads[r] += numel[i]
    return owners
