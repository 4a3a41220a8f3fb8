"""The model registry, the reference transformer and model summaries."""
