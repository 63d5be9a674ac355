"""LightningModules: one generic image classifier with networks injected from the zoo."""

from modules.classifier import ImageClassifier

__all__ = ["ImageClassifier"]
