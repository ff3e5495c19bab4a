"""Runs SGLang's frontend language against each URL given, with the interpreter of `.venv-sglang`: a
`RuntimeEndpoint` (which reads /get_model_info when it starts) and one greedy `gen`; prints a JSON line per URL with
the model name it read and the text generated."""

import json
import sys

import sglang as sgl
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint


@sgl.function
def complete(s):  # type: ignore[no-untyped-def]
    s += "def add(a, b):" + sgl.gen("text", max_tokens=8, temperature=0)


for url in sys.argv[1:]:
    endpoint = RuntimeEndpoint(url)
    sgl.set_default_backend(endpoint)
    print(json.dumps({"model": endpoint.get_model_name(), "text": complete.run()["text"]}))
