"""Speculative decoding: proposers behind one interface (`proposer.Proposer`), verification by rejection sampling
(`rejection`), and the runner's side of a verification step (`verify_step`)."""
