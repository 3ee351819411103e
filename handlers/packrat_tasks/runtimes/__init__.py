"""One module per packrat.runtime (packrat.modes.RUNTIMES), each with build(): the mode's callable.

    build(module, example_inputs, config, precision, runner) -> run(*tensors) -> tensor

    eager        the module under torch.inference_mode()
    torchscript  torch.jit.trace -> freeze -> optimize_for_inference
    inductor     torch.compile with inductor freezing, batch dim dynamic
    onnxruntime  legacy ONNX export, ONNX Runtime CPU session
    openvino     the same ONNX graph compiled by OpenVINO's CPU plugin
    ipex         intel-extension-for-pytorch's optimize + TorchScript
                 (optional extra; importable only beside torch 2.8)

Shared pieces: layout.py (channels-last for convolution models), onnx_export.py
(the module as an ONNX file), exported.py (that file, or the int8-static one,
through the build cache). packrat_tasks.runtime holds the registry and builds,
warms up and guards a mode; nothing here imports it. torch and the foreign
runtimes are imported by the builders, never at import time.
"""
