"""Serve a fine-tuned model: an OpenAI-compatible HTTP API and a chat page (docs/inference.md).

    python llm/server.py --model_name_or_path OUT --port 8000
    python llm/server.py --model_name_or_path LORA_OUT --api_key SECRET     # an adapter dir: its base + it
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
        -d '{"model": "OUT", "messages": [{"role": "user", "content": "Hi"}], "stream": true}'

Keys: python llm/server.py --help. Needs: pip install 'paddletune[serve]'.
"""
import os
import sys

try:
    import paddletune  # noqa: F401
except ImportError:  # running from a source checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paddletune.serve.cli import main

if __name__ == "__main__":
    sys.exit(main())
