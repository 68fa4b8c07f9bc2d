from .trainer import MapStyleSource, Trainer  # noqa: F401
