"""Device-side execution: the only package that holds device arrays."""
