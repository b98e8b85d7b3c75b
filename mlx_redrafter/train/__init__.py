"""Drafter training: the distillation corpus (`corpus`), derived features (`features`), losses, the training
loop and evaluation."""
