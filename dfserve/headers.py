"""HTTP headers dfserve itself defines, shared by the gateway (which honours them) and the load tester (which sends them).

`x-dfserve-arm` on a request pins it to that gateway arm (a paired load test through one gateway); on a response it
names the arm that answered, and `x-dfserve-replica` the replica.
"""

ARM = "x-dfserve-arm"
REPLICA = "x-dfserve-replica"

_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def is_field_name(name: str) -> bool:
    """Whether `name` can name a header (RFC 9110's token): what a request can carry, and a client can send."""
    return bool(name) and set(name) <= _TOKEN
