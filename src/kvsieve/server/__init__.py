"""OpenAI-compatible HTTP serving on the engine (`kvsieve serve`; needs the `serve` extra).

    from kvsieve.engine import LLMEngine
    from kvsieve.server import create_app
    app = create_app(LLMEngine.load(method="tactic"), "smollm2-135m-instruct")  # uvicorn.run(app)

driver.py: the thread that owns the engine; app.py: the FastAPI routes; schemas.py: the
request bodies; cli.py: the `serve` command.
"""


def create_app(*args, **kwargs):
    from .app import create_app as make

    return make(*args, **kwargs)


__all__ = ["create_app"]
