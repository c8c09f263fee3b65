"""Model memory: what a model's weights take (from their safetensors file) and which models
stay resident on a memory budget (Rafiqi's memory manager)."""
