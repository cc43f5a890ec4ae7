// The Python side of a kernel extension module: targets() (FFI target name -> PyCapsule of its XLA
// FFI handler, what kernels/native.py registers with XLA), isa() and set_isa(name), plus the
// kernel's own methods. Each kernel .cc is its own extension module, so the state here is that
// module's: it has internal linkage (an unnamed namespace), so that no build's symbol visibility can
// merge two modules' copies.
#pragma once

#include <Python.h>

#include <cstring>
#include <utility>
#include <vector>

#include "isa.h"

namespace slipstream::runtime {

struct FfiTarget {
  const char* name;
  void* handler;  // the XLA_FFI_DEFINE_HANDLER_SYMBOL function
};

struct ModuleSpec {
  const char* name;  // "_sampling": the extension kernels._sampling
  const char* doc;
  std::vector<FfiTarget> targets;
  IsaChoice* isa;
  std::vector<PyMethodDef> methods;  // the kernel's own (tuning setters), without the sentinel
};

namespace {

ModuleSpec*& Spec() {
  static ModuleSpec* spec = nullptr;
  return spec;
}

PyObject* Targets(PyObject*, PyObject*) {
  PyObject* dict = PyDict_New();
  if (!dict) return nullptr;
  for (const FfiTarget& t : Spec()->targets) {
    PyObject* capsule = PyCapsule_New(t.handler, nullptr, nullptr);
    if (!capsule || PyDict_SetItemString(dict, t.name, capsule) < 0) {
      Py_XDECREF(capsule);
      Py_DECREF(dict);
      return nullptr;
    }
    Py_DECREF(capsule);
  }
  return dict;
}

PyObject* GetIsa(PyObject*, PyObject*) { return PyUnicode_FromString(IsaName(Spec()->isa->get())); }

PyObject* SetIsa(PyObject*, PyObject* arg) {
  const char* name = PyUnicode_AsUTF8(arg);
  if (!name) return nullptr;
  IsaChoice& choice = *Spec()->isa;
  for (Isa isa : kAllIsas) {
    if (!choice.has(isa) || std::strcmp(name, IsaName(isa)) != 0) continue;
    if (static_cast<int>(isa) > static_cast<int>(choice.best())) {
      PyErr_Format(PyExc_ValueError, "this CPU cannot run %s (best: %s)", name, IsaName(choice.best()));
      return nullptr;
    }
    return PyUnicode_FromString(IsaName(choice.set(isa)));
  }
  PyErr_Format(PyExc_ValueError, "unknown instruction set %s", name);
  return nullptr;
}

// PyInit_<name>'s body: `spec` must outlive the module (a function-local static).
PyObject* CreateModule(ModuleSpec& spec) {
  Spec() = &spec;
  static std::vector<PyMethodDef> methods;
  methods = {
      {"targets", Targets, METH_NOARGS, "FFI target name -> PyCapsule of its XLA FFI handler."},
      {"isa", GetIsa, METH_NOARGS, "Instruction set the kernel uses on this CPU."},
      {"set_isa", SetIsa, METH_O,
       "Choose a (not faster than detected) instruction set; returns the previous."},
  };
  methods.insert(methods.end(), spec.methods.begin(), spec.methods.end());
  methods.push_back({nullptr, nullptr, 0, nullptr});
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, spec.name, spec.doc, -1, methods.data()};
  return PyModule_Create(&def);
}

}  // namespace
}  // namespace slipstream::runtime
