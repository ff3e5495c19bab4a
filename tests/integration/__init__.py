"""Real servers on loopback (each binds port 0 and says which it got), subprocesses and installed tools."""
