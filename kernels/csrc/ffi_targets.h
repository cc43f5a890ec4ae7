// The `targets()` of every kernel module: FFI target name -> PyCapsule of its XLA FFI handler, the
// dict kernels/native.py registers with XLA. Include after Python.h.
#pragma once

#include <initializer_list>
#include <utility>

inline PyObject* FfiTargetsDict(std::initializer_list<std::pair<const char*, void*>> handlers) {
  PyObject* dict = PyDict_New();
  if (!dict) return nullptr;
  for (const auto& [name, fn] : handlers) {
    PyObject* capsule = PyCapsule_New(fn, nullptr, nullptr);
    if (!capsule || PyDict_SetItemString(dict, name, capsule) < 0) {
      Py_XDECREF(capsule);
      Py_DECREF(dict);
      return nullptr;
    }
    Py_DECREF(capsule);
  }
  return dict;
}
