"""HTTP headers dfserve itself defines, shared by the gateway (which honours them) and the load tester (which sends them).

`x-dfserve-arm` on a request pins it to that gateway arm (a paired load test through one gateway); on a response it
names the arm that answered, and `x-dfserve-replica` the replica.
"""

ARM = "x-dfserve-arm"
REPLICA = "x-dfserve-replica"
