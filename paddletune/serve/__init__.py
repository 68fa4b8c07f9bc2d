"""Serve a fine-tuned model over HTTP: an OpenAI-compatible API (chat / completions, streaming,
batched KV-cache decoding) and a chat page. Needs the `serve` extra (starlette, uvicorn);
nothing here is imported by training.

    python llm/server.py --model_name_or_path OUT          # or: python -m paddletune.serve ...

engine.py   BatchEngine: requests within a short window decode together; finished rows leave
detok.py    incremental detokenizer for streams (incomplete UTF-8, SentencePiece's "▁")
app.py      the HTTP endpoints and OpenAI-style errors
cli.py      arguments, model loading, uvicorn
static/     the chat page (one HTML file, no build step, works offline)
"""
