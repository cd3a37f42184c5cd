"""[loop] POST /v1/audio/transcriptions: OpenAI's multipart request, answered by an audio-capable chat model.

Each clip goes to the chat path as one user turn: Gemma's published transcription instruction, the
request's ``prompt`` (if any) after it, then the audio; the reply is stripped of surrounding whitespace.
A file longer than one clip is cut into fixed windows of ``WINDOW_S`` seconds, no overlap (Gemma 4's
processor keeps at most 30 s of a clip: 750 soft tokens at 40 ms); they decode together (one batch)
and their texts join with a space. The windows go as 16-bit PCM WAV at the model's rate: mlx-audio's
reader decodes through 16-bit PCM, so a 16 kHz mono file's windows are its samples exactly.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from vlmserve.api.chat import Call, open_call, run_to_end
from vlmserve.api.errors import APIError, bad_request
from vlmserve.api.flight import GONE, all_or_none, until_done_or_disconnect
from vlmserve.api.schemas import ChatCompletionRequest
from vlmserve.api.state import ServerState
from vlmserve.preprocess.audio import AudioError, AudioLimits, decode_audio, pcm_wav, windows

WINDOW_S = 30.0
MAX_SECONDS = 600.0  # a transcription's file: twenty windows at most
FORMATS = {"wav": "wav", "mp3": "mp3", "mpga": "mp3", "mpeg": "mp3"}  # file extension -> decoder
# Gemma's published instruction for speech recognition (the model card's ASR prompt)
INSTRUCTION = ("Transcribe the following speech segment in {language}. Follow these specific instructions for "
               "formatting the answer:\n* Only output the transcription, with no newlines.\n* When transcribing "
               "numbers, write the digits, i.e. write 1.7 and not one point seven, and write 3 instead of three.")


async def create_transcription(http: Request, state: ServerState) -> Response:
    form = await http.form()
    fields = {k: v for k, v in form.items() if isinstance(v, str)}
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise bad_request("file: a multipart file part is required", "file", "missing_file")
    model = fields.get("model") or ""
    shape = fields.get("response_format", "json")
    if shape not in ("json", "text"):
        raise bad_request(f"response_format: {shape!r} is not supported (json, text)", "response_format")
    samples, rate = await _decoded(upload, state, model)
    texts = await _transcribe(http, state, model, fields, [pcm_wav(w, rate) for w in windows(samples, rate, WINDOW_S)])
    text = " ".join(t for t in texts if t)
    return PlainTextResponse(text) if shape == "text" else JSONResponse({"text": text})


async def _decoded(upload: UploadFile, state: ServerState, model: str) -> tuple[np.ndarray, int]:
    """The file's samples at the model's rate, decoded off the event loop; 400s for what cannot be."""
    fmt = FORMATS.get((upload.filename or "").rpartition(".")[2].lower())
    if fmt is None:
        raise bad_request(f"file: {upload.filename!r} is not a {', '.join(sorted(set(FORMATS.values())))} file", "file",
                          "invalid_audio")
    async with state.using(model) as served:
        refused = served.engine.media_refusal(0, 0, 1)
        rate = served.engine.prompter.audio_rate if served.engine.prompter is not None else None
    if refused is not None or rate is None:
        raise bad_request(refused or f"model {model!r} does not take audio", "model", "unsupported_media")
    raw = await upload.read(state.media.audio.max_bytes + 1)
    limits = AudioLimits(state.media.audio.max_bytes, MAX_SECONDS)
    try:
        samples = await asyncio.get_running_loop().run_in_executor(None, decode_audio, raw, fmt, "file", limits, rate)
    except AudioError as exc:
        raise bad_request(str(exc), "file", "invalid_audio") from None
    return samples, rate


async def _transcribe(http: Request, state: ServerState, model: str, fields: dict[str, str],
                      clips: list[bytes]) -> list[str]:
    calls: list[Call] = []
    try:
        for clip in clips:  # submitted together: they share the decode steps
            call = await open_call(_request(model, fields, clip), http, state, f"transcr-{uuid.uuid4().hex}")
            if call is None:
                raise APIError(499, "the client went away", "invalid_request_error")
            calls.append(call)
        lasts = await until_done_or_disconnect(http, all_or_none([run_to_end(c) for c in calls]),
                                               lambda: [c.flight for c in calls])
    except BaseException:
        for call in calls:
            await call.flight.close()
        raise
    if lasts is GONE:
        raise APIError(499, "the client went away", "invalid_request_error")
    return [(c.builder.content or "").strip() for c in calls]


def _request(model: str, fields: dict[str, str], clip: bytes) -> ChatCompletionRequest:
    language = fields.get("language")
    instruction = INSTRUCTION.format(language=f"{language} into {language} text" if language else
                                     "its original language")
    parts: list[dict[str, Any]] = [{"type": "text", "text": instruction}]
    if fields.get("prompt"):  # OpenAI's: text the transcription may continue or spell like
        parts.append({"type": "text", "text": fields["prompt"]})
    parts.append({"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"}})
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": parts}],
                            "temperature": fields.get("temperature") or 0.0}
    if fields.get("max_tokens"):
        body["max_tokens"] = _positive(fields["max_tokens"], "max_tokens")
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:  # a temperature out of range
        error = exc.errors()[0]
        raise bad_request(f"{'.'.join(map(str, error['loc']))}: {error['msg']}", "temperature") from None


def _positive(value: str, name: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise bad_request(f"{name}: {value!r} is not a whole number >= 1", name)
    return number
