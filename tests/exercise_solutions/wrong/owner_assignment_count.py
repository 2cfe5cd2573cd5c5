def assign_owners(shapes, world_size):
    """Largest first, but a rank's load counts its parameters, not their elements."""
    numel = []
    for shape in shapes:
        k = 1
        for d in shape:
            k *= d
        numel.append(k)
    count, owners = [0] * world_size, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: -numel[i]):
        r = count.index(min(count))
        owners[i] = r
        count[r] += 1
    return owners
