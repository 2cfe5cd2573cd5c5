def assign_owners(shapes, world_size):
    """Sorted as (numel, index) pairs with reverse=True: equal sizes come last index first."""
    numel = []
    for shape in shapes:
        k = 1
        for d in shape:
            k *= d
        numel.append(k)
    loads, owners = [0] * world_size, [0] * len(shapes)
    for k, i in sorted(((k, i) for i, k in enumerate(numel)), reverse=True):
        r = loads.index(min(loads))
        owners[i] = r
        loads[r] += k
    return owners
