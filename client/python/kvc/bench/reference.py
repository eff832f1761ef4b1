"""Python prototypes of new compression methods (filled in below)."""

PROTOTYPES = {}


def compress(spec, shadow, layers_in, dtype):
    name, _, rest = spec.partition(":")
    if name not in PROTOTYPES:
        raise ValueError(f"unknown prototype {name!r} (known: {', '.join(sorted(PROTOTYPES))})")
    return PROTOTYPES[name](rest, shadow, layers_in, dtype)
