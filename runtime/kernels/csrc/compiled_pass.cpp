// depctl_native::run_pass: a compiled pass's AOTInductor library, called without Python's GIL
// (runtime/model/compiled.py).
//
// torch's own Python binding of the package loader (AOTICompiledModel, AOTIModelPackageLoader.boxed_run) keeps the
// GIL for the whole call. In the daemon that serialises the engine thread and the event loop: every other Python
// thread waits out the pass, so a step's streamed output is written only once the pass ends. Called as a torch op, the pass
// runs with the GIL released, as every ATen op does, and the HTTP side works during it.
//
// The loader is held by a TorchBind class, so the op takes it as an argument; it borrows the model's weights
// (load_constants with user_managed), as the Python loader did.

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

struct CompiledPass : torch::CustomClassHolder {
  explicit CompiledPass(const std::string& package, int64_t device_index)
      : loader(std::make_unique<torch::inductor::AOTIModelPackageLoader>(package, "model", false, 1,
                                                                          static_cast<c10::DeviceIndex>(device_index))) {}

  std::vector<std::string> constant_names() { return loader->get_constant_fqns(); }

  void borrow_constants(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors) {
    TORCH_CHECK(names.size() == tensors.size(), "borrow_constants: ", names.size(), " names for ", tensors.size(),
                " tensors");
    std::unordered_map<std::string, at::Tensor> constants;
    for (size_t i = 0; i < names.size(); ++i) constants.emplace(names[i], tensors[i]);
    loader->load_constants(constants, /*use_inactive=*/false, /*check_full_update=*/true, /*user_managed=*/true);
  }

  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader;
};

std::vector<at::Tensor> run_pass(const c10::intrusive_ptr<CompiledPass>& compiled, std::vector<at::Tensor> inputs) {
  return compiled->loader->boxed_run(std::move(inputs));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(depctl_native, m) {
  m.class_<CompiledPass>("CompiledPass")
      .def(torch::init<std::string, int64_t>())
      .def("constant_names", &CompiledPass::constant_names)
      .def("borrow_constants", &CompiledPass::borrow_constants);
  m.def("run_pass(__torch__.torch.classes.depctl_native.CompiledPass compiled, Tensor[] inputs) -> Tensor[]", run_pass);
}
