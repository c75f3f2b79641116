"""DataFlow: graphs of function and model nodes deployed on chosen devices."""
