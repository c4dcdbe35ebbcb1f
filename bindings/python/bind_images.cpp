// Images in the client's stores and layers in a node's cache.
#include "bind_internal.hpp"

namespace dsec::python {

void bind_images(py::module_& m) {
  py::class_<dsec::CachedLayer>(m, "CachedLayer", "An image layer in a node's cache.")
      .def_readonly("digest", &dsec::CachedLayer::digest)
      .def_readonly("size", &dsec::CachedLayer::size)
      .def_readonly("cached_bytes", &dsec::CachedLayer::cached_bytes)
      .def_readonly("users", &dsec::CachedLayer::users)
      .def_readonly("images", &dsec::CachedLayer::images, "The images (name:tag) the node knows to hold it.")
      .def("__repr__", [](const dsec::CachedLayer& l) {
        return "CachedLayer(digest='" + l.digest + "', size=" + std::to_string(l.size) +
               ", cached_bytes=" + std::to_string(l.cached_bytes) + ", users=" + std::to_string(l.users) + ")";
      });

  py::class_<dsec::ImageLayerInfo>(m, "ImageLayerInfo", "A layer of an image in a store.")
      .def_readonly("role", &dsec::ImageLayerInfo::role)
      .def_readonly("digest", &dsec::ImageLayerInfo::digest)
      .def_readonly("size", &dsec::ImageLayerInfo::size)
      .def_readonly("stored_size", &dsec::ImageLayerInfo::stored_size)
      .def("__repr__", [](const dsec::ImageLayerInfo& l) {
        return "ImageLayerInfo(role='" + l.role + "', digest='" + l.digest + "', size=" + std::to_string(l.size) + ")";
      });

  py::class_<dsec::ImageInfo>(m, "ImageInfo", "An image in one of the client's stores, as `dsec image ls` shows it.")
      .def_readonly("name", &dsec::ImageInfo::name)
      .def_readonly("tag", &dsec::ImageInfo::tag)
      .def_readonly("reference", &dsec::ImageInfo::reference)
      .def_readonly("digest", &dsec::ImageInfo::digest)
      .def_readonly("layers", &dsec::ImageInfo::layers)
      .def_readonly("size", &dsec::ImageInfo::size)
      .def_readonly("stored_size", &dsec::ImageInfo::stored_size)
      .def_readonly("created_at", &dsec::ImageInfo::created_at)
      .def_readonly("source", &dsec::ImageInfo::source)
      .def_readonly("parent", &dsec::ImageInfo::parent)
      .def_readonly("store", &dsec::ImageInfo::store)
      .def("__repr__", [](const dsec::ImageInfo& i) {
        return "ImageInfo(reference='" + i.reference + "', digest='" + i.digest +
               "', layers=" + std::to_string(i.layers.size()) + ", size=" + std::to_string(i.size) + ")";
      });
}

}  // namespace dsec::python
