"""SGLang's protocol from the engine's side: requests as an SGLang server reads them (`requests`), the bodies it
answers (`bodies`), and how it refuses or fails a request (`answers`). Shapes follow SGLang 0.5.23:
``python/sglang/srt/managers/io_struct.py`` (GenerateReqInput), ``sampling/sampling_params.py`` (``verify``),
``entrypoints/http_server.py`` and ``entrypoints/openai/{protocol,serving_chat,serving_completions}.py``; the suite
checks them against SGLang's own pydantic models.

    from dfserve.sglang import server
    request = server.parse_generate_request(body)
"""

from dfserve.sglang.server.answers import (
    STREAM_ERROR_TYPE,
    UNAUTHORIZED,
    Answer,
    authorized,
    error_answer,
    error_response,
    failure_answer,
    native_error_event,
    openai_error_event,
)
from dfserve.sglang.server.bodies import (
    NativeStreamEncoder,
    ResponseHead,
    chat_chunk_body,
    chat_completion_body,
    completion_body,
    completion_chunk_body,
    finish_reason_body,
    generate_response_body,
    meta_info_body,
    model_info_body,
    models_body,
    openai_finish_reason,
    server_info_body,
    spec_details_body,
    sse_event,
    stream_end_chunks,
    usage_body,
)
from dfserve.sglang.server.requests import (
    COMPLETIONS_MAX_TOKENS,
    NATIVE_MAX_NEW_TOKENS,
    SAMPLING_FIELDS,
    EngineRequest,
    RequestError,
    Stage,
    context_error,
    parse_chat_request,
    parse_completions_request,
    parse_generate_request,
    verify,
)

__all__ = [
    "COMPLETIONS_MAX_TOKENS",
    "NATIVE_MAX_NEW_TOKENS",
    "SAMPLING_FIELDS",
    "STREAM_ERROR_TYPE",
    "UNAUTHORIZED",
    "Answer",
    "EngineRequest",
    "NativeStreamEncoder",
    "RequestError",
    "ResponseHead",
    "Stage",
    "authorized",
    "chat_chunk_body",
    "chat_completion_body",
    "completion_body",
    "completion_chunk_body",
    "context_error",
    "error_answer",
    "error_response",
    "failure_answer",
    "finish_reason_body",
    "generate_response_body",
    "meta_info_body",
    "model_info_body",
    "models_body",
    "native_error_event",
    "openai_error_event",
    "openai_finish_reason",
    "parse_chat_request",
    "parse_completions_request",
    "parse_generate_request",
    "server_info_body",
    "spec_details_body",
    "sse_event",
    "stream_end_chunks",
    "usage_body",
    "verify",
]
