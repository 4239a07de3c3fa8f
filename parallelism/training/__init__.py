"""The model family used for real training (torch): layers, models, deterministic init and synthetic data."""
