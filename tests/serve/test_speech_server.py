"""`kvforge serve` of an encoder-decoder export (kvforge/serve/speech.py): OpenAI's audio endpoints through the
`openai` client on a real socket, concurrent requests, and each bad upload a 400 naming it with the server still
serving."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from seq2seq_testing import seq2seq_export
from serving import serving

pytest.importorskip("fastapi")
soundfile = pytest.importorskip("soundfile")
pytest.importorskip("multipart")

RATE = 16000


def _wav(seconds: float, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    samples = (0.1 * np.sin(2 * np.pi * (150 + 40 * seed) * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)
    out = io.BytesIO()
    soundfile.write(out, samples, RATE, format="WAV", subtype="FLOAT")
    return out.getvalue()


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    from kvforge.runtime.drivers.seq2seq import Seq2SeqGenerator
    from kvforge.runtime.drivers.transcribe import Transcriber
    from kvforge.serve.app import create_app

    export = seq2seq_export(tmp_path_factory, "whisper") / "export"
    app = create_app(export, threads=1, model_name="whisper-tiny")
    app.state.handlers.max_audio_bytes = 400_000  # small limits, to test them without big uploads
    app.state.handlers.max_audio_seconds = 10
    with serving(app) as base:
        yield dict(base=base, alone=Transcriber(Seq2SeqGenerator(export, threads=1)))


@pytest.mark.xdist_group("seq2seq")
def test_the_openai_client_transcribes_what_the_transcriber_gives(speech):
    from openai import OpenAI

    client = OpenAI(base_url=f"{speech['base']}/v1", api_key="unused")
    data = _wav(4.0, 1)
    expected = speech["alone"].transcribe(data, language="en")
    got = client.audio.transcriptions.create(model="whisper-tiny", file=("a.wav", data, "audio/wav"), language="en")
    assert got.text == expected.text
    timed = speech["alone"].transcribe(data, language="en", timestamps=True)
    verbose = client.audio.transcriptions.create(model="whisper-tiny", file=("a.wav", data, "audio/wav"),
                                                 language="en", response_format="verbose_json")
    assert verbose.text == timed.text and verbose.language == "en"
    assert [(s.start, s.end, s.tokens) for s in verbose.segments] == [
        (s["start"], s["end"], s["tokens"]) for s in timed.windows[0]["segments"]]
    translated = client.audio.translations.create(model="whisper-tiny", file=("a.wav", data, "audio/wav"),
                                                  response_format="text")
    assert translated.strip() == speech["alone"].transcribe(data, task="translate").text
    srt = client.audio.transcriptions.create(model="whisper-tiny", file=("a.wav", data, "audio/wav"), language="en",
                                             response_format="srt")
    first = timed.windows[0]["segments"][0]
    assert srt.startswith(f"1\n00:00:{int(first['start']):02d},{round(first['start'] % 1 * 1000):03d} --> ")


@pytest.mark.xdist_group("seq2seq")
def test_16_concurrent_transcriptions_equal_each_alone(speech):
    import httpx

    clips = [_wav(1.0 + (i % 4) * 0.5, i) for i in range(16)]
    alone = [speech["alone"].transcribe(clip, language="en").text for clip in clips]
    assert len(set(alone)) > 1  # different clips, different answers: a mix-up would show

    def ask(clip: bytes) -> list[int]:
        response = httpx.post(f"{speech['base']}/v1/audio/transcriptions", timeout=120,
                              files={"file": ("a.wav", clip, "audio/wav")}, data={"language": "en"})
        assert response.status_code == 200, response.text
        return response.json()["text"]

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(ask, clips)) == alone


@pytest.mark.xdist_group("seq2seq")
@pytest.mark.parametrize("upload, status, message", [
    (b"RIFF\x00\x00garbage" * 20, 400, "the uploaded file is not audio this server reads: audio bytes (260 bytes) "
                                      "could not be decoded"),
    (b"", 400, "the uploaded file is empty"),
    (b"\x00" * 500_000, 400, "the uploaded file is 500000 bytes, over this server's limit of 400000 bytes"),
    ("long", 400, "the audio is 12.0 s long, over this server's limit of 10 s"),
])
def test_a_bad_upload_is_a_400_that_names_it_and_the_server_goes_on(speech, upload, status, message):
    import httpx

    data = upload
    if upload == "long":  # a 12 s clip in 16-bit samples, under the byte limit
        samples = np.zeros(12 * RATE, np.float32)
        out = io.BytesIO()
        soundfile.write(out, samples, RATE, format="WAV", subtype="PCM_16")
        data = out.getvalue()
    response = httpx.post(f"{speech['base']}/v1/audio/transcriptions", files={"file": ("a.wav", data, "audio/wav")},
                          timeout=60)
    assert response.status_code == status
    assert response.json()["error"]["message"].startswith(message)
    assert httpx.get(f"{speech['base']}/health").json()["status"] == "ok"


@pytest.mark.xdist_group("seq2seq")
def test_a_wrong_content_type_and_a_text_endpoint_are_refused(speech):
    import httpx

    wrong = httpx.post(f"{speech['base']}/v1/audio/transcriptions", json={"file": "x"})
    assert wrong.status_code == 415 and "send the file as 'multipart/form-data'" in wrong.json()["error"]["message"]
    text = httpx.post(f"{speech['base']}/v1/completions", json={"model": "whisper-tiny", "prompt": "hi"})
    assert text.status_code == 404 and "is a speech model" in text.json()["error"]["message"]
    words = httpx.post(f"{speech['base']}/v1/audio/transcriptions", files={"file": ("a.wav", _wav(1.0, 2))},
                       data={"timestamp_granularities[]": "word"})
    assert words.status_code == 400 and "only 'segment' is supported" in words.json()["error"]["message"]
    prompted = httpx.post(f"{speech['base']}/v1/audio/transcriptions", files={"file": ("a.wav", _wav(1.0, 2))},
                          data={"prompt": "Earlier text.", "language": "en"})
    assert prompted.status_code == 400 and prompted.json()["error"]["message"].startswith(
        "prompt: not supported by this server; it takes file, model, language")


@pytest.mark.xdist_group("seq2seq")
def test_a_text_encoder_decoder_answers_completions_with_the_generators_text(tmp_path_factory):
    """The tiny T5 (with its tokenizer.json) behind `kvforge serve`: the openai client's completions, one prompt and
    a list of them, give what the Seq2SeqGenerator gives for the same source texts; the audio endpoints are a 404."""
    import httpx
    from openai import OpenAI

    from kvforge.runtime.drivers.seq2seq import Seq2SeqGenerator
    from kvforge.serve.app import create_app

    export = seq2seq_export(tmp_path_factory, "t5") / "export"
    alone = Seq2SeqGenerator(export, threads=1)
    sources = ["summarize: the cat sat on the mat", "translate English to German: good morning"]
    with serving(create_app(export, threads=1, model_name="t5-tiny")) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="none")
        one = client.completions.create(model="t5-tiny", prompt=sources[0], max_tokens=10)
        both = client.completions.create(model="t5-tiny", prompt=sources, max_tokens=10)
        audio = httpx.post(f"{base}/v1/audio/transcriptions", files={"file": ("a.wav", _wav(1.0, 1))})
        sampled = client.completions.create(model="t5-tiny", prompt=sources[1], max_tokens=10, temperature=1.3,
                                            top_p=0.9, seed=5)
        refused = {key: httpx.post(f"{base}/v1/completions", json={"prompt": "x", key: value}).json()["error"]
                   for key, value in (("stream", True), ("n", 2), ("stop", ["."]))}
    from kvforge.runtime.controls.sampling import SamplingConfig

    config = SamplingConfig(greedy=False, temperature=1.3, top_p=0.9, seed=5)
    assert sampled.choices[0].text == alone.generate(sources[1:], max_new_tokens=10, sampling=config)[0]
    assert sampled.choices[0].text != alone.generate(sources[1:], max_new_tokens=10)[0]  # sampled, not greedy
    for key, error in refused.items():
        assert error["message"].startswith(f"{key}: not supported for an encoder-decoder export; it takes model, "
                                           "prompt, max_tokens"), error
    expected = alone.generate(sources, max_new_tokens=10)
    assert one.choices[0].text == expected[0]
    assert [choice.text for choice in both.choices] == expected
    assert both.usage.prompt_tokens == sum(len(alone.tokenizer().encode(s)) for s in sources)
    assert audio.status_code == 404 and "is a text model" in audio.json()["error"]["message"]


def test_decoder_only_server_settings_are_refused_in_one_line(tmp_path_factory):
    from kvforge.core.errors import InputError
    from kvforge.serve.app import create_app

    export = seq2seq_export(tmp_path_factory, "whisper") / "export"
    with pytest.raises(InputError, match=r"is an encoder-decoder export: --speculate, --prefill-chunk does not apply "
                                         r"to it \(its server batches on ONNX Runtime CPU"):
        create_app(export, speculate="prompt-lookup", prefill_chunk=64)
    with pytest.raises(InputError, match=r"is an encoder-decoder export: --chat-template does not apply"):
        create_app(export, chat_template="chatml")
