//! Conversion from Kubernetes API objects to the model, with validation.
