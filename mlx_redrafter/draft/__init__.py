"""Draft sources' models and how they draft: the ReDrafter RNN head and its beam search, lookup indices over the
context, Medusa heads and their static trees, the semi-autoregressive drafter, and the registry of kinds."""
