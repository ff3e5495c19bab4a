"""Capture of live requests for replay: the format (`format`), the redaction policy (`redact`), the writer the
gateway's observers feed (`writer`, `gateway`), the verified reader (`read`) and the load tester's task source
(`replay`)."""
