"""llmdp: differentially private fine-tuning of Hugging Face causal LMs on Ray Train."""

__version__ = "0.1.0"
