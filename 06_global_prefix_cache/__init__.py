"""Chapter 6: a global prefix cache shared across processes and nodes."""
