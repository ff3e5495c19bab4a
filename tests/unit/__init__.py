"""Logic tested in one process: no sockets, no subprocesses, no installed tools."""
