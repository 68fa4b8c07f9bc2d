"""paddletune: fine-tune and pre-train LLMs with PaddlePaddle from JSON argument files."""
from setuptools import find_packages, setup

setup(
    name="paddletune",
    version="0.1.0",
    description="PaddlePaddle toolkit for LLM fine-tuning (SFT, LoRA, Prefix Tuning, QLoRA) "
    "with Hugging Face checkpoints in and out",
    python_requires=">=3.9",
    packages=find_packages(include=["paddletune", "paddletune.*"]),
    package_data={"paddletune": ["assets/*/*", "assets/*/*/*", "kernels/*.cc", "kernels/*.h", "serve/static/*"]},
    install_requires=[
        "numpy",
        "safetensors",
        "tokenizers",
        "sentencepiece",
        "jinja2",
        "jsonlines",
        "tqdm",
        "pyyaml",   # YAML argument files (paddletune/args.py:read_yaml)
    ],
    extras_require={
        # paddle comes from exactly one of these; both cannot be required at once.
        "cpu": ["paddlepaddle==3.3.1"],
        "gpu": ["paddlepaddle-gpu==3.3.1"],
        # report_to / the PNG of the curves (paddletune/trainer/reporting.py, tools/plot_curves.py);
        # with paddlepaddle 3.3.1's protobuf (7.x): visualdl 2.5.3, tensorboard 2.21, matplotlib 3.11
        "visualdl": ["visualdl>=2.5.3"],
        "tensorboard": ["tensorboard>=2.21"],
        "plot": ["matplotlib>=3.7"],
        # llm/server.py / python -m paddletune.serve (paddletune/serve): never imported by training
        "serve": ["starlette>=0.37", "uvicorn>=0.29"],
        # test oracles only: never imported by the library (the three extras above: their tests)
        "test": ["pytest", "torch==2.13.0", "transformers", "peft", "trl", "psutil", "sacrebleu",
                 "rouge-score", "tiktoken", "visualdl>=2.5.3", "tensorboard>=2.21", "matplotlib>=3.7",
                 "starlette>=0.37", "uvicorn>=0.29", "httpx", "openai", "selenium"],
    },
)
