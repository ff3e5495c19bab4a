"""A simulated SGLang engine: SGLang's HTTP API with modelled acceptance and latency, for machines without GPUs.

Users rehearse A/B tests, dashboards and gates against it before spending GPU hours. Everything it returns says it
is simulated (`dfserve.sglang.simulated`).
"""
