"""Getting a drafter onto an engine: SGLang, the simulated engine, or Kubernetes."""
