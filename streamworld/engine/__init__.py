"""Stream state, scheduling and execution; for now the sequential reference generator."""

from .reference import GenerationRequest, GenerationResult, ReferenceGenerator

__all__ = ["GenerationRequest", "GenerationResult", "ReferenceGenerator"]
