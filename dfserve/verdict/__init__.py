"""The verdict core: what a candidate is judged on, whoever measured it.

A source (the load test's requests, the offline evaluation's tasks, later a shadow run's requests) fills one
`Pairs` of paired units and names its metrics (`MetricSpec`); a `Design` (`fixed.FixedN`, the paired task
bootstrap, or `sequential.Sequential`, confidence sequences) decides each gate rule on them; `verdict.Verdict` is
what is written and promoted. Nothing here knows what a request or an anchor is.
"""
